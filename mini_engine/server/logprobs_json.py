"""A request's log-probabilities as OpenAI's two endpoints write them, and vLLM's prompt_logprobs:
each token by its text (its own decode, special tokens included), -inf as vLLM's -9999.0."""
import itertools

from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.server.async_engine import RequestDelta


def end_offset(logprobs: dict | None, offset: int) -> int:
    """The text offset after a delta's tokens (completion_logprobs), or offset without them."""
    if not logprobs or not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


class LogprobsJSON:
    def __init__(self, tokenizer, as_token_ids: bool = False):
        """as_token_ids: vLLM's return_tokens_as_token_ids, each token named "token_id:{id}" (as
        it is anyway without a tokenizer), its bytes in chat logprobs those of that name."""
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def token_text(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok is None or self.as_token_ids:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, delta: RequestDelta, text_offset: int) -> dict | None:
        """text_offset: where the delta's first token starts. Each token's offset counts the
        characters of the token strings before it, as vLLM counts them: the text a stop string
        holds back, or deltas merged under load, do not move them."""
        if delta.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in delta.token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp.logprob, -9999.0) for lp in delta.logprobs],
            "top_logprobs": [self.top_logprobs(token, lp) for token, lp in zip(tokens, delta.logprobs)],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=text_offset))
                           if tokens else [],
        }

    def top_logprobs(self, token: str, lp: SampleLogprobs) -> dict[str, float]:
        """OpenAI's legacy top_logprobs of one token: "the API will always return the logprob of
        the sampled token, so there may be up to logprobs+1 elements", so the token first, as
        vLLM's, then its row's best, by text (-inf as vLLM's -9999.0)."""
        return {token: max(lp.logprob, -9999.0)} | {self.token_text(t): max(v, -9999.0) for t, v in lp.top}

    def chat_logprobs(self, delta: RequestDelta) -> dict | None:
        """OpenAI's chat logprobs for a delta's tokens: each token's text, its log-probability and
        its UTF-8 bytes, and its row's top_logprobs best likewise (-inf as vLLM's -9999.0)."""
        if delta.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}
        return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(u, v) for u, v in lp.top]}
                            for t, lp in zip(delta.token_ids, delta.logprobs)]}

    def delta_logprobs(self, delta: RequestDelta, chat: bool, offset: int) -> tuple[dict | None, int]:
        """A delta's logprobs as its endpoint returns them, and the text offset after its tokens
        (which only completions' logprobs count)."""
        if chat:
            return self.chat_logprobs(delta), offset
        logprobs = self.completion_logprobs(delta, offset)
        return logprobs, end_offset(logprobs, offset)

    def echoed_prompt_logprobs(self, tokens: list[str], values: list[SampleLogprobs | None]) -> dict:
        """An echoed prompt's tokens as completions' logprobs write a completion's (None for the
        first, which nothing predicts), from the prompt's prompt_logprobs."""
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else max(lp.logprob, -9999.0) for lp in values],
            "top_logprobs": [None if lp is None else self.top_logprobs(token, lp) for token, lp in zip(tokens, values)],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)),
        }

    def prompt_logprobs_json(self, prompt_token_ids: list[int], values: list) -> list[dict | None]:
        """vLLM's: for each prompt position, None (the first), or the prompt token and the top
        ones, by token id, each with its logprob, rank and text."""
        def entry(logprob: float, rank: int, token_id: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}
        out = []
        for token_id, lp in zip(prompt_token_ids, values):
            if lp is None:
                out.append(None)
                continue
            top = {t: entry(v, rank, t) for rank, (t, v) in enumerate(lp.top, start=1)}
            out.append(top | {token_id: entry(lp.logprob, lp.rank, token_id)})
        return out
