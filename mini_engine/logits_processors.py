"""Custom logits processors, as vLLM v1's (`LLM(model, logits_processors=[MyProcessor])`, the
server's `--logits-processors pkg.module:MyProcessor`): code of the user's that changes each step's
logits before the sampler draws from them.

A processor works on the whole batch. It keeps what it needs of each request by its index in a
persistent batch, which update_state learns of at every step (BatchUpdate: who left, who came,
who moved), and apply changes the step's logits, row i being the request at index i. Requests opt
in through SamplingParams.extra_args (the server's `vllm_xargs`), which validate_params checks
when the request arrives. The interface is vLLM's V1 one, so that a processor written for it
runs here with its imports changed; its constructor takes this engine's EngineConfig where vLLM
gives its VllmConfig.

The engine's own row order changes every step (longest context first: engine.build_rows), so
PersistentBatch turns each step's rows into removals, additions and moves. While a
processor is loaded every step samples outside the CUDA graphs (the forward pass still replays
them). A processor may read a request's output tokens on the host, where with async scheduling
the newest is still being sampled by the step before when the step is scheduled: so, as vLLM's
runner does, the processors run once the step's forward is queued, after the host has waited for
the step before's tokens (LLMEngine.fill_in_flight_tokens). The GPU has the forward to run
meanwhile, and the host's scheduling still overlaps the step before.
"""
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial

import torch

from mini_engine.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()     # the request at a goes to b, which was empty; a is empty after
    SWAP = auto()               # the requests at a and b trade places


# (index, the request's sampling params, its prompt token ids (None for a prompt given as
# embeddings), its output token ids: a live view of the request's list. When update_state and apply
# run it holds every token sampled so far; between steps its last may be a placeholder (-1) for the
# token the step in flight is sampling.)
AddedRequest = tuple[int, SamplingParams, list[int], Sequence[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the last step. Apply removed, then added, then
    moved: an added or moved request may take an index that a removed one held. An index is never
    both removed and added, so applying added before removed (as vLLM's own helpers do) is right too."""
    batch_size: int
    removed: list[int] = field(default_factory=list)
    added: list[AddedRequest] = field(default_factory=list)
    moved: list[MovedRequest] = field(default_factory=list)


class LogitsProcessor(ABC):
    """vLLM v1's interface (vllm.v1.sample.logits_processor.LogitsProcessor)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raises ValueError for a request whose parameters (its extra_args, most often) this
        processor cannot take; the request is refused before it is queued."""

    @abstractmethod
    def __init__(self, config, device: torch.device, is_pin_memory: bool):
        """config: the engine's EngineConfig (max_num_seqs, model_config.vocab_size, ...)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits, [batch_size, vocab] fp32, row i the request at index i; returns them
        changed (in place or a new tensor)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if apply never changes a row's argmax (as min_p's filter): such a processor runs
        after temperature, on the scaled logits, as vLLM runs it, and cannot change a greedy row."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step that samples: the batch's changes, or None when it is as it was."""


def process_dict_updates(entries: dict[int, object], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int], Sequence[int]], object | None]) -> bool:
    """Keeps a processor's per-request state, {index: state}, in step with the batch: new_state
    gives an added request's state, or None where the processor leaves it alone (as vLLM's helper
    of the same name). Returns whether entries changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[index] = state
            changed = True
        else:
            changed |= entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        at_a, at_b = entries.pop(a, None), entries.pop(b, None)
        if at_a is not None:
            entries[b] = at_a
        if direction is MoveDirectionality.SWAP and at_b is not None:
            entries[a] = at_b
        changed |= at_a is not None or at_b is not None
    return changed


# A per-request processor, as vLLM's: (output token ids, the row's logits) -> logits, or
# (prompt token ids, output token ids, the row's logits) -> logits.
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper for per-request processors: subclass it, and give new_req_logits_processor
    and is_argmax_invariant. Each request that new_req_logits_processor gives a callable has its
    row passed through it, one row at a time (the price of code written per request)."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool):
        self.config, self.device = config, device
        self.rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's processor, or None to leave its row alone."""

    def bind(self, params: SamplingParams, prompt_ids: list[int], output_ids: Sequence[int]):
        processor = self.new_req_logits_processor(params)
        if processor is None:
            return None
        takes_prompt = len(inspect.signature(processor).parameters) == 3
        return partial(processor, prompt_ids, output_ids) if takes_prompt else partial(processor, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self.bind)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, processor in self.rows.items():
            logits[index] = processor(logits[index])
        return logits


class OutputTokens(Sequence):
    """A request's output token ids as a read-only view of its token list, so that a processor
    holding it sees each new token as the engine appends it (vLLM hands processors the list itself)."""
    __slots__ = ("seq",)

    def __init__(self, seq):
        self.seq = seq          # an engine Sequence: token_ids (prompt, then output) and num_prompt_tokens

    def __len__(self) -> int:
        return len(self.seq.token_ids) - self.seq.num_prompt_tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.seq.token_ids[self.seq.num_prompt_tokens:][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("output token index out of range")
        return self.seq.token_ids[self.seq.num_prompt_tokens + (i % n)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.seq.token_ids[self.seq.num_prompt_tokens:])

    def __repr__(self) -> str:
        return repr(self.seq.token_ids[self.seq.num_prompt_tokens:])

    def __eq__(self, other) -> bool:
        """Equal to a list (or tuple) of the same ids, as vLLM's processors, handed the list itself,
        may compare it."""
        if isinstance(other, (OutputTokens, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None


@dataclass(eq=False)
class LogitsRequest:
    """What a processor is told of one request when it joins the batch; one per engine Sequence,
    whose identity it keeps across steps (and across a preemption, after which it joins again)."""
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: OutputTokens


class PersistentBatch:
    """The processors' view of the batch: which request each index holds. update() takes the
    step's sampling rows in logits order and says how to get there from the last step's."""

    def __init__(self):
        self.slots: list[LogitsRequest | None] = []

    def update(self, requests: list[LogitsRequest]) -> BatchUpdate | None:
        n = len(requests)
        wanted = {id(r) for r in requests}
        removed = []
        for i, r in enumerate(self.slots):
            if r is not None and id(r) not in wanted:
                self.slots[i] = None
                removed.append(i)
        self.slots += [None] * (n - len(self.slots))
        where = {id(r): i for i, r in enumerate(self.slots) if r is not None}
        # A newcomer takes its own row's index where that is free, else the lowest free one.
        free = [i for i, r in enumerate(self.slots) if r is None]
        free_set = set(free)
        added = []
        for target, r in enumerate(requests):
            if id(r) in where:
                continue
            if target in free_set:
                index = target
            else:
                index = next(i for i in free if i in free_set)
            free_set.discard(index)
            self.slots[index] = r
            where[id(r)] = index
            added.append((index, r.params, r.prompt_token_ids, r.output_token_ids))
        taken = {a[0] for a in added}
        removed = [i for i in removed if i not in taken]
        # Then each row's request into its row: a move into an empty index, or a swap.
        moved = []
        for target, r in enumerate(requests):
            source = where[id(r)]
            if source == target:
                continue
            other = self.slots[target]
            self.slots[target], self.slots[source] = r, other
            where[id(r)] = target
            if other is None:
                moved.append((source, target, MoveDirectionality.UNIDIRECTIONAL))
            else:
                where[id(other)] = source
                moved.append((source, target, MoveDirectionality.SWAP))
        assert all(r is None for r in self.slots[n:])
        del self.slots[n:]
        if not (removed or added or moved):
            return None
        return BatchUpdate(n, removed, added, moved)


class LogitsProcessors:
    """The runner's loaded processors and their batch. Those that may change an argmax run after
    the grammar's mask, allowed_token_ids, logit_bias and the bans, before the penalties; the
    argmax-invariant ones after temperature: vLLM's order (layers/sampler.py).

    A processor that raises may leave its state, and the others', half updated: the processors
    are then made afresh, with an empty batch. Where update_state raised on a step that added
    requests, each added one is tried alone (on fresh processors each time) to find the ones it
    cannot take; those are set aside in `failed` (the engine ends them, "abort", with a warning)
    and their rows go on under stand-ins that opt into nothing. Any other failure fails the step."""

    def __init__(self, classes: tuple[type, ...], config, device: torch.device):
        self.classes, self.config, self.device = classes, config, device
        # The engine's: makes the output tokens of the step still in flight known on the host.
        self.before_update: Callable[[], None] | None = None
        self.failed: list[tuple[str, str]] = []     # (request id, why) of requests the processors refused
        self.restart()

    def restart(self) -> None:
        pin = self.device.type == "cuda"
        self.processors = [cls(self.config, self.device, pin) for cls in self.classes]
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self.others = [p for p in self.processors if not p.is_argmax_invariant()]
        self.batch = PersistentBatch()

    def update(self, requests: list[LogitsRequest]) -> None:
        if self.before_update is not None:
            self.before_update()
        known = {id(r) for r in self.batch.slots if r is not None}
        try:
            self.tell(requests)
        except Exception as e:
            added = {id(r) for r in requests} - known
            if not added:
                self.restart()
                raise
            self.find_refused(requests, added, e)

    def tell(self, requests: list[LogitsRequest]) -> None:
        batch_update = self.batch.update(requests)
        for processor in self.processors:
            processor.update_state(batch_update)

    def find_refused(self, requests: list[LogitsRequest], added: set[int], error: Exception) -> None:
        refused: dict[int, str] = {}
        while True:
            self.restart()
            rows = [stand_in() if id(r) in added else r for r in requests]
            try:
                self.tell(rows)         # the rows the processors held before: they took them then
            except Exception:
                self.restart()
                raise error from None
            for i, r in enumerate(requests):
                if id(r) not in added or id(r) in refused:
                    continue
                rows[i] = r
                try:
                    self.tell(rows)
                except Exception as e:
                    refused[id(r)] = f"{type(e).__name__}: {e}"
                    break
            else:
                break
        self.failed += [(r.request_id, refused[id(r)]) for r in requests if id(r) in refused]

    def apply(self, processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        try:
            for processor in processors:
                logits = processor.apply(logits)
        except Exception:
            self.restart()
            raise
        return logits

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self.failed = self.failed, []
        return failed


def stand_in() -> LogitsRequest:
    """A row's place in the processors' batch for a request they refused: default params, no tokens."""
    return LogitsRequest("", SamplingParams(), [], ())


def load_logits_processor(spec) -> type:
    """A processor class, or its qualified name: "pkg.module:Class" or "pkg.module.Class"."""
    if isinstance(spec, str):
        module_name, sep, name = spec.partition(":")
        if not sep:
            module_name, _, name = spec.rpartition(".")
        if not module_name or not name:
            raise ValueError(f"logits processor {spec!r}: give a class as 'package.module:Class' or "
                             "'package.module.Class'")
        try:
            spec = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"logits processor {spec!r} cannot be loaded: {e}") from None
    if not (isinstance(spec, type) and issubclass(spec, LogitsProcessor)):
        raise ValueError(f"logits processor {spec!r} is not a subclass of mini_engine.LogitsProcessor "
                         "(vLLM v1's interface)")
    if inspect.isabstract(spec):
        missing = ", ".join(sorted(spec.__abstractmethods__))
        raise ValueError(f"logits processor {spec.__name__} does not define {missing}")
    return spec


def load_logits_processors(specs) -> tuple[type, ...]:
    if specs is None:
        return ()
    if isinstance(specs, (str, type)) or not isinstance(specs, Sequence):
        raise ValueError(f"logits_processors must be a list of classes or qualified names, got {specs!r}")
    return tuple(load_logits_processor(spec) for spec in specs)
