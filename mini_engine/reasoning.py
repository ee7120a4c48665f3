"""Qwen3's thought (<think>...</think>) as the engine sees it. With a reasoning parser (vLLM's
`reasoning_parser`, which `--reasoning-parser qwen3` sets), structured outputs hold only what
follows the thought: the model thinks freely, and its answer is the grammar's. The server's
output parser (server/output_parsers.py) splits the text at the same tags."""
from dataclasses import dataclass

REASONING_PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    start: int
    end: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ThinkTokens":
        if tokenizer is None:
            raise ValueError("reasoning_parser needs the checkpoint's tokenizer (tokenizer.json)")
        ids = [tokenizer.token_to_id(tag) for tag in (THINK_START, THINK_END)]
        if None in ids:
            raise ValueError(f"reasoning_parser 'qwen3' needs {THINK_START} and {THINK_END} as tokens of "
                             "the tokenizer, as Qwen3's has them")
        return cls(*ids)

    def prompt_tag(self, tokenizer, prompt_token_ids: list[int]) -> int | None:
        """The think tag the prompt ends with (then whitespace), or None. Qwen3's template closes
        an empty thought there for enable_thinking=False (the output is all answer); the
        Thinking-2507 templates open one (the output thinks until </think>); with neither, the
        output may open one with its first token. The server's ReasoningParser reads the prompt's
        end and the output's start the same way. (vLLM's asks whether </think> is anywhere in the
        prompt, and otherwise waits for it: a model that never thinks is never held, and in a tool
        loop, where Qwen3's template keeps the turn's earlier thoughts, the output cannot think.)"""
        for token in reversed(prompt_token_ids):
            if token in (self.start, self.end):
                return token
            if tokenizer.decode([token], skip_special_tokens=False).strip():
                return None
        return None
