"""Structured outputs (vLLM's StructuredOutputsParams): a request's output held to a JSON schema,
any JSON object, a regular expression, one of a list of strings, or an EBNF grammar.

The grammar work is xgrammar's, a well-kept library: a matcher walks the grammar token by token
and fills a bitmask of the tokens that may come next. What is the engine's: a matcher per
sequence, advanced by each token it samples (LLMEngine.resolve), its bitmask set on the row
(LLMEngine.build_rows) and applied to the row's logits before anything else
(layers/penalties.py's apply_grammar_bitmask). A step with such a row samples outside the CUDA
graph, and while such a request runs the engine waits for each step's tokens before it schedules
the next: the mask needs the token that the step in flight samples.

A grammar compiles on a thread of its own (0.1 s to seconds at Qwen3's vocabulary, during which
xgrammar releases the GIL): its request waits to be scheduled, as vLLM's WAITING_FOR_FSM, while
the engine steps the others.
"""
import functools
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch


def xgrammar():
    try:
        import xgrammar as xgr
    except ModuleNotFoundError as e:
        raise ImportError(f"structured outputs need xgrammar: pip install xgrammar ({e})") from None
    return xgr


XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
MAX_COMPILED_GRAMMARS = 256     # a server's distinct schemas, kept compiled (the oldest goes first)
# JSON's whitespace between two tokens, at most (vLLM lets xgrammar allow any): models, small ones
# above all, can write whitespace forever once the grammar allows it; 16 still indents 7 levels.
MAX_WHITESPACE = 16


def grammar_error(e: Exception) -> ValueError:
    """xgrammar's C++ errors start with a time and a source line: the message is what follows."""
    return ValueError("structured_outputs: " + XGRAMMAR_ERROR_PREFIX.sub("", str(e)).strip())


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (the output is
    one of these strings), grammar (EBNF as xgrammar reads it, GBNF's dialect, rule `root` first),
    json_object (any JSON object: OpenAI's response_format json_object). JSON may hold up to
    MAX_WHITESPACE characters of whitespace between two of its tokens, or none with
    disable_any_whitespace (vLLM's)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar and "
                             f"json_object, got {given or 'none'}")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object, or its text), "
                             f"got {self.json!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    def spec(self) -> tuple[str, str]:
        """(kind, text): what the compiler compiles, and caches its result by."""
        if self.json_object:
            # Any object: the schema that allows one, so that disable_any_whitespace holds for it too.
            return "json" + ("" if self.disable_any_whitespace else " any whitespace"), '{"type": "object"}'
        if self.json is not None:
            # The schema's own key order: xgrammar writes an object's properties in it.
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json" + ("" if self.disable_any_whitespace else " any whitespace"), text
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        # Each choice a string literal of the grammar: JSON's escapes are EBNF's for " \ and controls.
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)

    def check(self) -> None:
        """Raises ValueError where the schema, regex or grammar is not one (no tokenizer needed:
        the server checks requests with it before they reach the engine)."""
        check_spec(*self.spec())


@functools.lru_cache(maxsize=MAX_COMPILED_GRAMMARS)
def check_spec(kind: str, text: str) -> None:
    """StructuredOutputsParams.check's work, done once a spec (a request's n completions, or a
    client that sends one schema again and again, check it once)."""
    xgr = xgrammar()
    try:
        if kind.startswith("json"):
            xgr.Grammar.from_json_schema(text, any_whitespace=kind != "json")
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except RuntimeError as e:
        raise grammar_error(e) from None


class OutputGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, bitmask_words: int):
        self.matcher = matcher
        self.bitmask = torch.zeros((1, bitmask_words), dtype=torch.int32)

    def next_token_bitmask(self, also_allowed: int | None = None) -> torch.Tensor:
        """[bitmask_words] int32: bit t % 32 of word t // 32 is set where token t may come next.
        The sequence's own buffer, refilled by the next call. also_allowed: a token outside the
        grammar that may come too (the <think> that opens an output's thought)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if also_allowed is not None:
            self.bitmask.numpy().view(np.uint32)[0, also_allowed // 32] |= np.uint32(1 << also_allowed % 32)
        return self.bitmask[0]

    def accept(self, token: int) -> bool:
        """False where the grammar does not allow the token (it is not taken)."""
        return self.matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token ended it: nothing may follow."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """The engine's: grammars compiled against its tokenizer (TokenizerInfo takes a second at
    Qwen3's 151k tokens, so it is made at the first structured request, holding the GIL), each
    compiled once on the compiler's thread and kept."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = xgrammar()
        # The vocabulary as xgrammar reads it: each token's own string, decoded by the tokenizer's
        # scheme (byte-level for Qwen3). Special tokens (<|im_start|>, ...) are the tokenizer's
        # control tokens, not text: written "" so that xgrammar never lets one stand for its text
        # inside a string (ids past the tokenizer's, up to the model's vocab_size, are never allowed).
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        vocab = ["" if i in special else tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size())]
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        vocab_type = xgr.VocabType.BYTE_LEVEL if "ByteLevel" in kinds else \
            xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in kinds else xgr.VocabType.RAW
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                 add_prefix_space="Metaspace" in kinds)
        self.compiler = xgr.GrammarCompiler(info, max_threads=4)
        self.bitmask_words = (vocab_size + 31) // 32
        # One thread: a grammar's compile already spreads over max_threads of xgrammar's own.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self.compiled: dict[tuple[str, str], Future] = {}       # touched by the engine's thread only

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar, to come: a new spec is queued on the compiler's thread, a known
        one (compiled, or still compiling) shared, one that failed or was called off queued again.
        Its result raises ValueError for a spec that does not compile (StructuredOutputsParams.check
        finds those first)."""
        key = params.spec()
        known = self.compiled.get(key)
        if known is not None and known.done() and (known.cancelled() or known.exception() is not None):
            del self.compiled[key]      # called off, or failed (perhaps for want of memory): once more
        if key in self.compiled:
            self.compiled[key] = self.compiled.pop(key)         # the newest now: the oldest goes first
        else:
            self.compiled[key] = self.executor.submit(self.compile_now, *key)
            if len(self.compiled) > MAX_COMPILED_GRAMMARS:
                del self.compiled[next(iter(self.compiled))]
        return self.compiled[key]

    def compile_now(self, kind: str, text: str):
        try:
            if kind.startswith("json"):
                whitespace = kind != "json"
                return self.compiler.compile_json_schema(
                    text, any_whitespace=whitespace, max_whitespace_cnt=MAX_WHITESPACE if whitespace else None)
            return self.compiler.compile_regex(text) if kind == "regex" else self.compiler.compile_grammar(text)
        except RuntimeError as e:
            raise grammar_error(e) from None

    def matcher(self, compiled, stop_token_ids: list[int]) -> OutputGrammar:
        """A new place at the start of a compiled grammar (a compile()'s result); stop_token_ids:
        the tokens that may end the output once the grammar is complete (EOS and the request's own)."""
        matcher = xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        return OutputGrammar(matcher, self.bitmask_words)
