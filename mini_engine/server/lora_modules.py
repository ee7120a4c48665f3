"""The server's LoRA adapters, as vLLM's serves them: `--lora-modules name=path ...` (or vLLM's
JSON items) names adapters that a request's `model` field picks, /v1/models lists them, and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True /v1/load_lora_adapter and /v1/unload_lora_adapter change
the list while the server runs. The engine reads and checks each adapter (LLMEngine.check_lora):
those of --lora-modules before the server is ready, so that a bad one stops it at start-up."""
import json
import os
from dataclasses import dataclass

from mini_engine.lora import LoRARequest
from mini_engine.server.protocol import ProtocolError, model_card

# vLLM's switch for the two runtime routes (vllm/envs.py reads "1" or "true", any case).
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """vLLM's: one --lora-modules item. base_model_name: the `parent` /v1/models shows (default:
    the served model's name); the adapter still runs on this server's model."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if item.lstrip().startswith("{"):
        try:
            fields = json.loads(item)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e}): {item}") from None
        if not isinstance(fields, dict) or not {"name", "path"} <= fields.keys() or \
                not fields.keys() <= {"name", "path", "base_model_name"}:
            raise ValueError(f'a JSON item takes "name", "path" and optionally "base_model_name": {item}')
        module = LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
    else:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"expected name=path or a JSON object, got {item!r}")
        module = LoRAModulePath(name, path)
    for key in ("name", "path"):
        if not isinstance(getattr(module, key), str) or not getattr(module, key):
            raise ValueError(f"the adapter's {key} must be a non-empty string: {item}")
    if module.base_model_name is not None and not isinstance(module.base_model_name, str):
        raise ValueError(f"base_model_name must be a string: {item}")
    return module


class LoRAModules:
    """The adapters a server runs, by name. Each gets the next lora_int_id (1, 2, ... in
    --lora-modules' order, then those loaded at run time), and an id is never given again, even
    after an unload: the engine keeps an id's adapter, and its prefix-cache blocks are that
    adapter's (mini_engine/lora.py AdapterCache)."""

    def __init__(self, base_model_name: str, modules: list[LoRAModulePath] = ()):
        self.base_model_name = base_model_name
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str | None] = {}
        self.last_id = 0
        for module in modules:
            self.add(self.new_request(module.name, module.path), module.base_model_name)

    def new_request(self, name: str, path: str) -> LoRARequest:
        """The LoRARequest for a new adapter of that name, not yet served (add serves it)."""
        if name == self.base_model_name:
            raise ValueError(f"the adapter's name {name!r} is the served model's")
        if name in self.requests:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")     # vLLM's words
        self.last_id += 1
        return LoRARequest(name, self.last_id, path)

    def add(self, request: LoRARequest, parent: str | None = None) -> None:
        if request.lora_name in self.requests:      # loaded by another request meanwhile
            raise ValueError(f"The lora adapter '{request.lora_name}' has already been loaded.")
        self.requests[request.lora_name] = request
        self.parents[request.lora_name] = parent

    def remove(self, name: str) -> None:
        del self.requests[name], self.parents[name]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """A request's `model`: the served model (or none given, or "": as vLLM, the served one) runs
        without an adapter, an adapter's name with it; any other name is a 404, in vLLM's words."""
        if not model or model == self.base_model_name:
            return None
        if model in self.requests:
            return self.requests[model]
        raise ProtocolError(f"The model `{model}` does not exist.", 404, "model", "model_not_found")

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models' entries for the adapters: as vLLM's, id the name, root the path, parent the
        base model (and, unlike vLLM's null, the max_model_len the adapter runs with)."""
        return [model_card(name, max_model_len, str(request.lora_path), self.parents[name] or self.base_model_name)
                for name, request in self.requests.items()]
