"""Beam search, as vLLM's LLM.beam_search does it: on top of generation, one engine step a token.

Each step every live beam is a request of one token that asks for its 2 x beam_width most likely
next tokens (the candidates HF's beam search keeps, so that beam_width of them survive even when
some end on EOS); the prefix cache holds the beam's tokens from its previous step, so a step
recomputes at most the beam's last block. Every candidate extends its beam by one token; those
that end on EOS (unless ignore_eos) are kept aside as completed, the others are ranked by
beam_search_score and the best beam_width go on. After max_tokens steps, the completed and the
live beams together are ranked once more and the best beam_width returned.

The candidates' log-probabilities are those of the raw logits (as vLLM reports logprobs):
temperature changes only which token the engine samples, and a sampled token outside the top
2 x beam_width joins the candidates, as it does in vLLM's logprobs dict.

BeamSearch is the search's state, apart from how a step's requests run: LLM.beam_search runs them
through generate() (run_beam_search), the server through its engine process, concurrently, as
vLLM's OpenAIServing.beam_search does (server/beam_search_endpoint.py).
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tqdm.auto import tqdm

from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.lora import LoRARequest
from mini_engine.outputs import RequestOutput
from mini_engine.sampling_params import SamplingParams, is_number


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (vllm.sampling_params), validated when made."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0        # the engine's sampled token, one more candidate where it is not a top one
    # The score divides the cumulative log-probability by the sequence's length (prompt included,
    # a final EOS not) to this power: above 1 favours longer sequences, below 1 shorter ones.
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False    # the text keeps the EOS that ended the sequence

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def num_candidates(self) -> int:
        """The top tokens each beam asks for a step."""
        return 2 * self.beam_width

    def step_params(self) -> SamplingParams:
        """A beam's request for one step: its next token and the candidates' log-probabilities."""
        return SamplingParams(temperature=self.temperature, max_tokens=1, logprobs=self.num_candidates)


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's BeamSearchSequence)."""
    tokens: list[int]               # the prompt's, then the generated ones (an EOS that ended it included)
    # One per generated token: its log-probability, and the step's top candidates it was chosen among.
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0        # the generated tokens' log-probabilities, summed
    text: str | None = None         # the tokens' text (the prompt's too), filled once it is returned
    finish_reason: str | None = None    # "stop" (EOS) or "length" (max_tokens), once returned
    stop_reason: int | None = None      # the EOS token id that ended it
    cache_salt: str | None = None       # its prompt's (vLLM's cache_salt), which each step's request keeps


@dataclass
class BeamSearchOutput:
    """One prompt's result: its best beam_width sequences, best first."""
    sequences: list[BeamSearchSequence]


@dataclass
class PromptBeams:
    """One prompt's search: its live beams, and those that EOS has ended."""
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's get_beam_search_score (HF's length-normalised score): the length counts the prompt,
    and not the EOS that ended the beam. (vLLM's leaves out any final EOS, so that under ignore_eos
    a child ending on EOS ranks below its siblings: one beam was then not greedy decoding.)"""
    seq_len = len(beam.tokens) - (beam.finish_reason == "stop")
    return beam.cum_logprob / seq_len ** length_penalty


class StepOutput(Protocol):
    """A beam's one-token request, run: generate()'s CompletionOutput, or the server's RequestDelta."""
    token_ids: list[int]                        # the token the engine sampled
    logprobs: list[SampleLogprobs] | None       # its log-probability, and the step's top tokens


def step_candidates(completion: StepOutput) -> list[tuple[int, float]]:
    """A beam's next tokens, from its one-token request: the top ones and, where the engine sampled
    another (temperature > 0), that one too."""
    step, sampled = completion.logprobs[0], completion.token_ids[0]
    if any(token == sampled for token, _ in step.top):
        return step.top
    return step.top + [(sampled, step.logprob)]


def text_token_ids(beam: BeamSearchSequence, params: BeamSearchParams) -> list[int]:
    """The tokens a returned beam's text shows (the prompt's included): all but the EOS that ended
    it, unless include_stop_str_in_output."""
    ends_on_eos = beam.finish_reason == "stop" and not params.include_stop_str_in_output
    return beam.tokens[:-1] if ends_on_eos else beam.tokens


class BeamSearch:
    """One search's bookkeeping, over any number of prompts, apart from how its steps run: the
    offline LLM runs each step's requests through generate() (run_beam_search), the server through
    its engine process, concurrently (server/beam_search_endpoint.py).

        search = BeamSearch(prompt_token_ids, loras, params, eos_token_ids)
        while beams := search.step_requests():
            ...run each beam's tokens (under its LoRA and cache salt) as a one-token request of
            params.step_params()...
            search.advance(their outputs, in order: each one's sampled token and logprobs)
        best = search.result()
    """

    def __init__(self, prompt_token_ids: list[list[int]], loras: list[LoRARequest | None], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], cache_salts: list[str | None] | None = None):
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.prompts = [PromptBeams([BeamSearchSequence(list(ids), lora_request=lora, cache_salt=salt)])
                        for ids, lora, salt in zip(prompt_token_ids, loras, cache_salts or [None] * len(loras))]
        self.num_steps = 0

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam, self.params.length_penalty)

    def step_requests(self) -> list[BeamSearchSequence]:
        """The beams the next step runs, each prompt's in turn; none once max_tokens steps have run
        or EOS has ended every beam."""
        if self.num_steps >= self.params.max_tokens:
            return []
        return [beam for prompt in self.prompts for beam in prompt.beams]

    def advance(self, outputs: list[StepOutput]) -> None:
        """The step's results, one for each of step_requests()' beams in its order. Every
        candidate extends its beam; EOS (unless ignore_eos) sets the child aside as completed, and
        each prompt keeps its best beam_width of the rest."""
        num_beams = sum(len(prompt.beams) for prompt in self.prompts)
        if len(outputs) != num_beams:
            raise ValueError(f"the step ran {num_beams} beams but {len(outputs)} results came")
        params, results = self.params, iter(outputs)
        for prompt in self.prompts:
            extended = []
            for beam in prompt.beams:
                output = next(results)
                top = output.logprobs[0].top
                for token, logprob in step_candidates(output):
                    child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [SampleLogprobs(logprob, top)],
                                               beam.lora_request, beam.cum_logprob + logprob,
                                               cache_salt=beam.cache_salt)
                    if token in self.eos_token_ids and not params.ignore_eos:
                        child.finish_reason, child.stop_reason = "stop", token
                        prompt.completed.append(child)
                    else:
                        extended.append(child)
            prompt.beams = sorted(extended, key=self.score, reverse=True)[:params.beam_width]
        self.num_steps += 1

    def result(self) -> list[list[BeamSearchSequence]]:
        """Each prompt's best beam_width sequences, best first: the completed and the live beams
        (finish_reason "length") ranked together. Their text is left to the caller
        (text_token_ids)."""
        best = []
        for prompt in self.prompts:
            for beam in prompt.beams:
                beam.finish_reason = "length"
            best.append(sorted(prompt.completed + prompt.beams, key=self.score, reverse=True)[:self.params.beam_width])
        return best


# Runs one step: each beam's token ids (under its LoRA adapter and cache salt) as a one-token
# request, in that order.
StepRunner = Callable[[list[BeamSearchSequence]], list[RequestOutput]]


def run_beam_search(prompt_token_ids: list[list[int]], loras: list[LoRARequest | None], params: BeamSearchParams,
                    eos_token_ids: frozenset[int], run_step: StepRunner, decode: Callable[[list[int]], str],
                    use_tqdm: bool = False, concurrency_limit: int | None = None,
                    cache_salts: list[str | None] | None = None) -> list[BeamSearchOutput]:
    """Each prompt's best params.beam_width sequences, best first. eos_token_ids: the tokens that
    end a beam (unless params.ignore_eos); decode: token ids to text; concurrency_limit (vLLM's):
    the prompts searched at a time (their beams are one step's requests), None for all;
    cache_salts: each prompt's, or None."""
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or
                                          isinstance(concurrency_limit, bool) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
    batch = concurrency_limit or max(len(prompt_token_ids), 1)
    cache_salts = cache_salts or [None] * len(prompt_token_ids)
    return [output for start in range(0, len(prompt_token_ids), batch)
            for output in search_prompts(prompt_token_ids[start:start + batch], loras[start:start + batch], params,
                                         eos_token_ids, run_step, decode, use_tqdm, cache_salts[start:start + batch])]


def search_prompts(prompt_token_ids: list[list[int]], loras: list[LoRARequest | None], params: BeamSearchParams,
                   eos_token_ids: frozenset[int], run_step: StepRunner, decode: Callable[[list[int]], str],
                   use_tqdm: bool, cache_salts: list[str | None]) -> list[BeamSearchOutput]:
    """run_beam_search's prompts, all at once, each step one run_step of every live beam."""
    search = BeamSearch(prompt_token_ids, loras, params, eos_token_ids, cache_salts)
    with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True) as bar:
        while beams := search.step_requests():
            outputs = run_step(beams)
            search.advance([output.outputs[0] for output in outputs])
            bar.update()
    results = []
    for best in search.result():
        for beam in best:
            beam.text = decode(text_token_ids(beam, params))
        results.append(BeamSearchOutput(best))
    return results
