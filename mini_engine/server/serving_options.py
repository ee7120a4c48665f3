"""The server's own options (vLLM's serving flags), beside the engine's (EngineConfig) and the
output parsers' (output_parsers.ParserOptions)."""
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServingOptions:
    # --chat-template: a template's text in place of the checkpoint's (or where it has none).
    chat_template: str | None = None
    # --trust-request-chat-template: a request may send its own chat_template (a template is code
    # the server runs, so only trusted clients should be let send one).
    trust_request_chat_template: bool = False
    # --enable-prompt-tokens-details: chat and completion usage say how many prompt tokens the
    # prefix cache served (`prompt_tokens_details.cached_tokens`); the Responses API always does.
    enable_prompt_tokens_details: bool = False
