"""LLM: the offline entry point, shaped like vLLM's."""
import time

from tqdm.auto import tqdm

from mini_engine.config import EngineConfig
from mini_engine.engine.engine import LLMEngine
from mini_engine.outputs import CompletionOutput, RequestOutput
from mini_engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")

        engine = self.engine
        # Validate every request before adding any, so a bad one costs the others nothing.
        token_ids = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                ids = engine.tokenize(prompt)
                engine.validate(ids, params)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            token_ids.append(ids)
        seqs = [engine.add_request(ids, params) for ids, params in zip(token_ids, sampling_params)]

        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                prefill_tokens += engine.last_step_prefill_tokens
                decode_tokens += engine.last_step_decode_tokens
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                                    f"decode {decode_tokens / elapsed:.0f} tok/s", refresh=False)
                bar.update(sum(o.finished for o in outputs))
        finally:
            bar.close()
            for seq in seqs:           # on an exception (e.g. KeyboardInterrupt) free what is left
                if not seq.is_finished:
                    engine.abort_request(seq.request_id)
        return [self.to_output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def to_output(self, seq, prompt) -> RequestOutput:
        text = self.engine.detokenize(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason,
                                      seq.logprobs if seq.sampling_params.logprobs is not None else None)],
            finished=True,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
        )
