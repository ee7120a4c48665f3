"""Speculative decoding: a proposer drafts each sequence's next tokens, and one step of the model
verifies them all. Two proposers, as vLLM names them in speculative_config:
- "ngram" ("prompt lookup decoding"): the tokens that followed the last time the sequence's newest
  n-gram appeared in its own prompt or output;
- "draft_model": a smaller model of the same vocabulary (Qwen3-0.6B for Qwen3-8B), run greedily
  for k tokens ahead (runner/draft_model.py).

How a step verifies k drafts (engine.build_rows): the sequence's last token and its k drafts go in
as k + 1 decode rows of the step, one a position, which share the sequence's block table. Row i's
context ends at its own position, so it attends to the drafts before it (each layer writes the
step's K and V before its attention reads) and to none after: causal attention, run by the decode
kernel and its CUDA graphs as they are. Each row samples a token with the request's own
parameters, as a decode step would from that context.

Which tokens are kept: row i's sample is the token at position i after the drafts before it. While
the samples equal the drafts, each draft is a token the request would have drawn itself; the first
sample that differs is kept too (the token drawn where the draft was wrong), and everything after
it is dropped. With drafts that are one token each (a proposer that gives no probabilities: the
n-gram lookup, or a draft model's greedy choice), this is the rejection sampling of Leviathan et al. exactly: a draft d is accepted with probability p(d),
and otherwise the token kept is drawn from p without d, renormalised. So outputs have the
distribution of plain decoding, greedy outputs are the same tokens, and a seeded request draws its
j-th output token from the same random stream either way (seed, j), so it is the same tokens too
(up to the numerics of the different batch shapes)."""
import dataclasses
from dataclasses import dataclass

from mini_engine.quantization import QUANTIZATION_METHODS

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """As vLLM's: method "ngram" or "draft_model" (the method vLLM infers when only a model is
    given); num_speculative_tokens, the most drafts a step verifies for a sequence. For "ngram":
    prompt_lookup_max and prompt_lookup_min, the longest and shortest suffix n-gram that is looked
    up (the longest that matches wins); either bound given alone sets both, and neither given sets
    both to 5, as vLLM's defaults. For "draft_model": model, the draft checkpoint's folder, and
    draft_tensor_parallel_size, which can only be 1 here (the draft runs whole on one device, beside
    the target's rank 0 where the target is split), and quantization, as EngineConfig's for the
    draft (None: whatever its checkpoint is; "fp8" quantizes a bf16 draft as it loads). disable_by_batch_size: no drafts while more requests than this are
    running or waiting (None: drafts at any batch size).

    A step with drafts runs synchronously (its tokens reach the host before the next step is
    scheduled): the proposer reads each sequence's newest token, and the next step's rows follow
    from how many drafts were accepted. A step without them keeps async_scheduling."""
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None

    @classmethod
    def resolve(cls, given: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(given, SpeculativeConfig):
            return given
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config must be a dict (vLLM's fields), got {given!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown fields {unknown}; this engine takes {sorted(known)}")
        method = given.get("method")
        if method is None and given.get("model") is not None:
            method = "draft_model"          # as vLLM infers it from a model that is no EAGLE or MTP head
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS} (EAGLE and MTP "
                             f"are not implemented), got {method!r}")
        k = given.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        limit = given.get("disable_by_batch_size")
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1 or None, got {limit!r}")
        if method == "draft_model":
            return cls.resolve_draft_model(given, k, limit)
        if any(given.get(name) is not None for name in ("model", "draft_tensor_parallel_size", "quantization")):
            raise ValueError("speculative_config: model, draft_tensor_parallel_size and quantization are the "
                             "draft_model method's; the ngram method drafts from the sequence itself")
        high, low = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        high, low = (low if high is None else high), (high if low is None else low)
        for name, value in (("prompt_lookup_max", high), ("prompt_lookup_min", low)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) is above prompt_lookup_max ({high})")
        return cls(method, k, high, low, limit)

    @classmethod
    def resolve_draft_model(cls, given: dict, k: int, limit: int | None) -> "SpeculativeConfig":
        model = given.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config: the draft_model method needs model, the draft checkpoint's "
                             f"folder, got {model!r}")
        if given.get("prompt_lookup_max") is not None or given.get("prompt_lookup_min") is not None:
            raise ValueError("speculative_config: prompt_lookup_max and prompt_lookup_min are the ngram method's")
        draft_tp = given.get("draft_tensor_parallel_size")
        if draft_tp not in (None, 1) or isinstance(draft_tp, bool):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be 1 (the draft model runs on "
                             f"one device, beside the target's rank 0), got {draft_tp!r}")
        quantization = given.get("quantization")
        if quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"speculative_config: quantization (the draft model's) must be one of "
                             f"{QUANTIZATION_METHODS} or None, got {quantization!r}")
        return cls("draft_model", k, disable_by_batch_size=limit, model=model, draft_tensor_parallel_size=1,
                   quantization=quantization)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class NgramIndex:
    """Where each token of a sequence occurs, brought up to date as the sequence grows: the n-gram
    lookup's candidates without a scan of the whole context every step (a scan of 2,000 tokens in
    Python, for each of a hundred running sequences, is milliseconds a step)."""
    positions: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    num_indexed: int = 0

    def update(self, token_ids: list[int]) -> None:
        for i in range(self.num_indexed, len(token_ids)):
            self.positions.setdefault(token_ids[i], []).append(i)
        self.num_indexed = len(token_ids)


def ngram_drafts(token_ids: list[int], index: NgramIndex, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of token_ids' last n tokens, for
    the largest n in [min_n, max_n] that occurs earlier (as vLLM's NgramProposer); [] where none
    does. Every n-gram that matches ends with the last token, so only that token's earlier places
    (index, which this brings up to date) are candidates, and the first whose match reaches max_n
    ends the search."""
    index.update(token_ids)
    last_index = len(token_ids) - 1
    best_length, best_end = 0, -1
    for end in index.positions[token_ids[last_index]]:
        if end == last_index:
            break
        length = 1
        while length < max_n and length <= end and token_ids[end - length] == token_ids[last_index - length]:
            length += 1
        if length > best_length:
            best_length, best_end = length, end
            if length == max_n:
                break
    if best_length < min_n:
        return []
    return token_ids[best_end + 1:best_end + 1 + k]


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the samples confirm: sampled[i] is the token drawn at draft i's
    position, after the drafts before it (len(sampled) == len(drafts) + 1)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: drafts verified (steps in which a sequence had any), draft
    tokens verified, draft tokens accepted, and the accepted drafts by position (0 = the first)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a sequence, on average: its accepted drafts and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
