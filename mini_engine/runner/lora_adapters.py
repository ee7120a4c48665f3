"""Which LoRA adapter each of the model's max_loras slots holds (layers/lora.py), as vLLM's LRU
of active adapters: a step's adapters get slots before its inputs are staged, a missing one
evicting the slot used least recently by none of the step's rows. The scheduler never runs more
than max_loras adapters at once (Scheduler.admits_lora), so a step always fits.

A step reads no file: before it launches, the engine has every adapter it runs in a slot or in
host memory (prepare, through AdapterCache, which re-reads one that max_cpu_loras evicted), so
that an adapter whose folder was deleted or damaged since its requests were added ends those
requests there (LLMEngine.read_adapters) and not the step with everyone in it.

A slot is written on the device's current stream, behind the steps already queued there: a step
still running on the adapter being evicted finishes before its slot changes. Under tensor
parallelism every rank runs the same rows through the same table, so the ranks agree on the
slots without a word; each takes its share of the adapter from the host copy rank 0 read and
sent it (tensor_parallel_workers.WorkerAdapters): a worker reads no file, so no rank can fail a
read that the others passed."""
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

    def prepare(self, request: LoRARequest) -> None:
        """Makes sure the next step can give request's adapter a slot without reading a file: a
        slot holds it already, or host memory does (read again now if max_cpu_loras evicted it).
        A step's adapters are at most max_loras <= max_cpu_loras, so preparing them all keeps them
        all. A ValueError if it can no longer be read."""
        if request.lora_int_id not in self.slot_of:
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

    def forget_slots(self) -> None:
        """Every slot held by no adapter: each is loaded again at its next step (after a weight
        update, whose norms its A has folded in, or a sleep that discarded the weights)."""
        self.held = [None] * self.max_loras
        self.slot_of.clear()

    def load(self, slot: int, request: LoRARequest) -> None:
        # In host memory (prepare): a read here only for a caller that drives the runner directly.
        adapter = self.cache.get(request)
        if self.held[slot] is not None:
            del self.slot_of[self.held[slot]]
            self.held[slot] = None
        # The slot is held only once every module holds the adapter: a load that fails half-way
        # leaves it held by none, so no row maps to it, and the next load rewrites it whole.
        for name, module in self.modules.items():
            pairs = [adapter.pairs.get(source) for source in self.model.checkpoint_names(name)]
            module.lora.load(slot, [None if pair is None else module.lora_pair(*pair) for pair in pairs])
        self.held[slot] = request.lora_int_id
        self.slot_of[request.lora_int_id] = slot
        self.num_loads += 1
