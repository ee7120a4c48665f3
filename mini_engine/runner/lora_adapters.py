"""Which LoRA adapter each of the model's max_loras slots holds (layers/lora.py), as vLLM's LRU
of active adapters: a step's adapters get slots before its inputs are staged, a missing one
evicting the slot used least recently by none of the step's rows. The scheduler never runs more
than max_loras adapters at once (Scheduler.admits_lora), so a step always fits.

A slot is written on the device's current stream, behind the steps already queued there: a step
still running on the adapter being evicted finishes before its slot changes. Under tensor
parallelism every rank runs the same rows through the same table, so the ranks agree on the
slots without a word, and each reads its share of the adapter from lora_path itself."""
from mini_engine.config import EngineConfig
from mini_engine.lora import AdapterCache, LoRARequest
from mini_engine.runner.batch import BatchRow


class LoRAAdapters:
    def __init__(self, model, config: EngineConfig):
        self.model = model
        self.modules = model.enable_lora(config.max_loras, config.max_lora_rank)
        self.cache = AdapterCache(config.model_config, config.max_lora_rank, config.max_cpu_loras)
        self.max_loras = config.max_loras
        self.held: list[int | None] = [None] * config.max_loras     # the adapter id in each slot
        self.slot_of: dict[int, int] = {}
        self.last_used = [0] * config.max_loras
        self.num_steps = 0
        self.num_loads = 0

    def check(self, request: LoRARequest) -> None:
        """Reads (or finds) the adapter: a ValueError that says what is wrong with it."""
        self.cache.get(request)

    def slots(self, rows: list[BatchRow]) -> list[int]:
        """Each row's slot (-1: no adapter), loading the step's adapters that no slot holds."""
        self.num_steps += 1
        wanted = {r.lora_request.lora_int_id: r.lora_request for r in rows if r.lora_request is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step mixes {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}")
        for lora_id, request in wanted.items():
            slot = self.slot_of.get(lora_id)
            if slot is None:
                slot = min((s for s in range(self.max_loras) if self.held[s] not in wanted),
                           key=lambda s: (self.held[s] is not None, self.last_used[s]))
                self.load(slot, request)
            self.last_used[slot] = self.num_steps
        return [-1 if r.lora_request is None else self.slot_of[r.lora_request.lora_int_id] for r in rows]

    def load(self, slot: int, request: LoRARequest) -> None:
        adapter = self.cache.get(request)
        if self.held[slot] is not None:
            del self.slot_of[self.held[slot]]
            self.held[slot] = None
        for name, module in self.modules.items():
            pairs = [adapter.pairs.get(source) for source in self.model.checkpoint_names(name)]
            module.lora.load(slot, [None if pair is None else module.lora_pair(*pair) for pair in pairs])
        self.held[slot] = request.lora_int_id
        self.slot_of[request.lora_int_id] = slot
        self.num_loads += 1
