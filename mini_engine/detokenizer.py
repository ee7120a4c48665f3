"""Incremental detokenization with stop strings: the server streams text with it, and both the
server and LLM.generate end a request when a stop string appears.

Decoding a token alone is wrong for byte-level BPE: one character of UTF-8 may span several
tokens, and a lone piece decodes to U+FFFD. The `tokenizers` library's DecodeStream keeps a short
window of tokens and gives only what the window adds once it ends on a whole character (the
prefix/read offsets of vLLM's detokenizer, which uses it too): one call a token, where decoding
the window from Python took two (benchmarks/NOTES.md, entry 66). When the request ends, the full
decode of every output token is the reference: whatever the window held back is emitted then, so
the streamed text equals the offline text.

Stop strings are matched on the text; the matched string and everything after it are dropped,
and while a request runs the last len(longest stop) - 1 characters are held back, since they may
be the start of a stop string that the next token completes. As in vLLM, none is matched until the
output has more than min_tokens tokens, and then only one that the newest text completes; with
include_stop (vLLM's include_stop_str_in_output) the text keeps the matched string, and the stop
token's text, and nothing is held back.

skip_special_tokens (vLLM's, on by default) leaves the tokenizer's special tokens out of the text.
The `tokenizers` library drops them before it decodes, so the bytes of one character on either side
of one still join (kept, it splits them into two U+FFFD); either way the streamed text is the one
decode of every token with the same flag. vLLM's
spaces_between_special_tokens has no counterpart: `tokenizers`' decode has no such option and writes
each added token as its own content with nothing around it; transformers' fast tokenizers ignore
the option (PreTrainedTokenizerFast's decode passes only skip_special_tokens on); and vLLM's fast
detokenizer, with it off, swaps in an added token's own content, which DecodeStream already gives.
Only transformers' slow (Python) tokenizers put spaces around added tokens, and this engine reads
tokenizer.json alone. So the text is the same either way, as vLLM's is for Qwen3.
"""
import logging
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from mini_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, stop: list[str] | None = None, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer          # None: no text (no checkpoint tokenizer, or detokenize=False)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.holdback = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.stream = None if tokenizer is None else DecodeStream(skip_special_tokens=skip_special_tokens)
        self.last_token: int | None = None      # the last one the stream took
        self.token_ids: list[int] = []
        self.text = ""              # decoded so far (stop strings cut off)
        self.num_sent = 0           # characters of self.text already returned
        self.stopped = False        # a stop string matched
        self.finished = False       # the request's last tokens came: later updates give nothing

    @classmethod
    def for_request(cls, tokenizer: Tokenizer | None, params: "SamplingParams") -> "IncrementalDetokenizer":
        """The text a request's SamplingParams ask for: none at all with detokenize=False."""
        return cls(tokenizer if params.detokenize else None, params.stop, params.min_tokens,
                   params.include_stop_str_in_output, params.skip_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool, stop_token: bool = False) -> str:
        """Adds tokens; returns the text that may now be sent. After a stop string matched,
        self.stopped is set and later calls return nothing. stop_token: the request ended on a
        stop token (stop_token_ids or EOS), whose text, as in vLLM, is not part of the output."""
        if self.stopped or self.finished:
            return ""
        self.finished = finished
        if stop_token and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        full = self.decode(self.token_ids) if finished else None
        if full is not None and full.startswith(self.text):
            new_text = full[len(self.text):]
        # A byte-level decoder's full decode only ever extends the streamed text; a byte-fallback one
        # may take back a character it gave (its bytes turn invalid beside the next ones): then what
        # was sent stands, and the stream goes on with the new tokens.
        elif len(new_token_ids) == 1:
            new_text = self.step(new_token_ids[0])
        else:
            new_text = "".join([self.step(token) for token in new_token_ids])
        self.append(new_text)
        end = len(self.text) if finished or self.stopped else len(self.text) - self.holdback
        if end <= self.num_sent:
            return ""
        out = self.text[self.num_sent:end]
        self.num_sent = end
        return out

    def step(self, token: int) -> str:
        """What one more token adds to the streamed text: "" while it ends inside a character (or
        is a skipped special token)."""
        try:
            piece = self.stream.step(self.tokenizer, token)
        except Exception as e:
            # A byte-fallback decoder (Llama's, Gemma's, read through `tokenizer`) may decode a
            # window of invalid bytes to a text that does not extend the one before; DecodeStream
            # then raises rather than take back what it gave. A fresh stream goes on from this token
            # (vLLM's detokenizer does the same), given the token before it first, whose text is
            # already out, so that this one's leading space survives a decoder that strips the
            # first; the full decode at the end is still the reference.
            if "Invalid prefix" not in str(e):
                raise
            logger.debug("detokenizer: %s; decoding on from token %d", e, token)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            if self.last_token is not None:
                self.stream.step(self.tokenizer, self.last_token)
            piece = self.stream.step(self.tokenizer, token)
        self.last_token = token
        return piece or ""

    def update_until_stop(self, new_token_ids: list[int], finished: bool, stop_token: bool = False) -> tuple[str, int]:
        """update() a token at a time, as steps of one token each would: the text, and how many
        of the tokens it took, up to the one that completed a stop string (all of them if none
        did). A step of speculative decoding brings several tokens, and those after a stop string
        are dropped (the caller cuts them), since plain decoding never makes them."""
        if len(new_token_ids) == 1:         # a decode step's one token: the server's every step
            return self.update(new_token_ids, finished, stop_token), 1
        text = ""
        for i, token in enumerate(new_token_ids):
            last = i == len(new_token_ids) - 1
            text += self.update([token], finished and last, stop_token and last)
            if self.stopped:
                return text, i + 1
        if not new_token_ids:
            text = self.update([], finished, stop_token)
        return text, len(new_token_ids)

    def append(self, new_text: str) -> None:
        if not new_text:
            return
        end_before = len(self.text)
        self.text += new_text
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return
        # Only a match that the new text completes: one that may begin in the held-back tail. (A
        # short stop string written while min_tokens held matching back is not found later.)
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, max(0, end_before - len(s) + 1))) >= 0]
        if hits:
            start, length = min(hits)           # the first to begin (of those, the shortest)
            self.text = self.text[:start + length if self.include_stop else start]
            self.stopped = True
