"""OpenAI's request and response shapes (the subset we serve), as pydantic models.

Requests forbid unknown fields, and the parameters below that OpenAI defines but we do not
implement are accepted only at their neutral value: a client that asks for something we cannot do
gets a 400, never a silently different answer.
"""
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_LOGPROBS = 20


def validate_cache_salt(value):
    # vLLM's check, before any conversion, with its words: null is no salt, "" or a non-string a 400.
    if value is not None and (not isinstance(value, str) or not value):
        raise PydanticCustomError("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
    return value


# extension (vLLM's, on completions, chat and responses): the prompt's prefix-cache blocks serve only
# requests with the same salt, so that hit timings tell one tenant nothing of another's prompts. It
# should be secret and unguessable (vLLM suggests 256 random bits, 43 base64 characters).
CacheSalt = Annotated[str | None, BeforeValidator(validate_cache_salt)]


class ProtocolError(ValueError):
    """A request we reject: becomes OpenAI's error JSON with this status."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status_code, self.param, self.code = status_code, param, code


def error_body(message: str, status_code: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {404: "not_found_error"}.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status_code}}


def error_response(message: str, status_code: int = 400, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(raw, req: "SamplingRequest", engine_id: str) -> str:
    """A completion's id, as vLLM's: the engine's id's prefix on the client's X-Request-Id header or
    its request_id field, where it sent one, else the engine's own id (raw: the HTTP request)."""
    base = raw.headers.get("x-request-id") or req.request_id
    return f"{engine_id.split('-', 1)[0]}-{base}" if base else engine_id


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # As OpenAI: a stream ends with a usage chunk (its choices empty) only when asked, since
    # clients that read chunk.choices[0] of every chunk fail on it. continuous_usage_stats (vLLM's):
    # every chunk also carries the usage so far; it asks for the usage chunk too, unless
    # include_usage is false (vLLM's include_usage defaults to true, so there it always does).
    include_usage: bool | None = None
    continuous_usage_stats: bool = False


# The sampling fields that beam search leaves alone, and their neutral values (what a client that
# sends every field sends): one of them set otherwise is refused with use_beam_search.
BEAM_SEARCH_NEUTRAL = {
    "top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "min_tokens": (0,), "seed": (None,),
    "stop": (None, []), "stop_token_ids": ([],), "prompt_logprobs": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "structured_outputs": (None,), "logit_bias": (None, {}), "vllm_xargs": (None, {}),
}


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None            # as vLLM's: none (or "") is the served model
    # extension (vLLM's): the base of the response's id ("cmpl-{request_id}"); an X-Request-Id header
    # wins over it. The engine's own ids stay unique whatever a client sends.
    request_id: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = None
    # Absent or null (OpenAI allows both): the checkpoint's generation_config.json default, else
    # SamplingParams' (EngineConfig.default_sampling_params), which the server leaves to them.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None            # extension (vLLM's): -1 or 0 is off
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None     # extension (vLLM's)
    min_p: float | None = None                  # extension (vLLM's)
    min_tokens: int = 0                         # extension (vLLM's)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # extension
    ignore_eos: bool = False            # extension
    include_stop_str_in_output: bool = False    # extension (vLLM's)
    skip_special_tokens: bool = True            # extension (vLLM's, chat's default too): no <|im_end|> in the text
    spaces_between_special_tokens: bool = True  # extension (vLLM's): no effect with tokenizer.json (detokenizer.py)
    # extension (vLLM's): generate from the prompt's last k tokens (-1: max_model_len), which usage counts
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None          # extension (vLLM's; not with stream)
    # extension (vLLM's): logprobs name each token "token_id:{id}" (null: as --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: list[int] | None = None  # extension (vLLM's)
    bad_words: list[str] | None = None          # extension (vLLM's)
    # extension (vLLM's): {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ebnf} |
    # {"json_object": true}, and disable_any_whitespace
    structured_outputs: dict[str, Any] | None = None
    # extension (vLLM's): the request's SamplingParams.extra_args, which custom logits processors
    # (--logits-processors) read
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    n: int | None = 1
    priority: int = 0                   # extension (vLLM's): with --scheduling-policy priority, lower first
    cache_salt: CacheSalt = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None             # accepted and ignored, as OpenAI's own
    # Accepted only at their neutral values (checked in unsupported()).
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's beam search: n is the beam width and the n best beams are the choices, ranked by
    # cum_logprob / seq_len ** length_penalty (server/beam_search_endpoint.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # OpenAI's {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}: the last two held to by structured outputs.
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.response_format is not None and self.response_format.get("type") not in \
                ("text", "json_object", "json_schema"):
            return "response_format"
        if self.best_of not in (None, 1):
            return "best_of"
        return None

    def beam_search_ignores(self) -> str | None:
        """The first field set (away from its neutral values) that beam search does not use: it
        ranks beams by their tokens' log-probabilities alone, where vLLM's drops these silently."""
        for name, neutral in BEAM_SEARCH_NEUTRAL.items():
            if getattr(self, name) not in neutral:
                return name
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        return None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        if options is None:
            return False
        return options.continuous_usage_stats if options.include_usage is None else options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    # A prompt or a batch; or, with --enable-prompt-embeds, vLLM's prompt_embeds in its place: each
    # a base64 of torch.save(a [num_tokens, hidden_size] tensor) (engine/prompt_embeds.py).
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def beam_search_ignores(self) -> str | None:
        return "echo" if self.echo else super().beam_search_ignores()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")    # name, tool_calls, ...: passed to the template
    role: str
    content: str | list[ContentPart] | None = None


class FunctionDefinition(BaseModel):
    # Other keys (OpenAI's strict, ...) go to the chat template with the rest, as vLLM passes them.
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema, shown to the model by the chat template


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True          # extension
    # extension (vLLM's): the final message left open, no end of turn after it, for the model to
    # continue (a prefilled answer); the choices hold the continuation. Not with add_generation_prompt.
    continue_final_message: bool = False
    # extension (vLLM's): the final message's content goes before each choice's, where that message
    # has the response's role (the assistant's; with add_generation_prompt false, any)
    echo: bool = False
    # extension (vLLM's): a Jinja template in place of the server's, refused unless the server was
    # started with --trust-request-chat-template
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. {"enable_thinking": false}
    tools: list[ToolDefinition] | None = None
    # "auto" (the default with tools): the model chooses, and the server's tool call parser finds
    # its calls; "none": the tools are shown to the model but its output is not parsed; "required"
    # and a named function ({"type": "function", "function": {"name": ...}}): structured outputs
    # hold the output to calls, as vLLM's.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None     # False: the first call only

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def beam_search_ignores(self) -> str | None:
        # "required" or a named function: structured outputs would hold the output to a call.
        if self.tools and self.tool_choice not in (None, "auto", "none"):
            return "tool_choice"
        return super().beam_search_ignores()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt's token ids, or those of chat messages through the chat template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: as the server's endpoints tokenize, without them for completions (Qwen3's adds none) and for
    # messages, with them for an embedding server's input (Qwen3-Embedding's appends <|endoftext|>)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None            # as the chat endpoint's (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False             # the vocabulary's own strings (byte-level pieces)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class PoolingInputRequest(BaseModel):
    """What the pooling endpoints share: the prompts, as `input` (a text, token ids, or a batch of
    either), or as chat `messages` rendered by the chat template into one prompt (vLLM's
    EmbeddingChatRequest, ClassificationChatRequest and PoolingChatRequest); exactly one of the two."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults for a pooling chat: the conversation as it is, no assistant turn opened after it
    add_generation_prompt: bool = False
    continue_final_message: bool = False        # the last message left open, no end of turn after it
    chat_template: str | None = None            # as the chat endpoint's (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    # The tokenizer's own special tokens, as Qwen3-Embedding's appends the <|endoftext|> it pools. None:
    # vLLM's defaults, with them for input, without for messages (the chat template writes its own)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None   # extension (vLLM's): pool the last k tokens (-1: max_model_len)
    user: str | None = None                     # accepted and ignored, as OpenAI's own
    priority: int = 0                           # extension (vLLM's): with --scheduling-policy priority


class EmbeddingRequest(PoolingInputRequest):
    """OpenAI's /v1/embeddings, with vLLM's extensions, for a server started with --runner pooling."""
    encoding_format: Literal["float", "base64"] = "float"     # base64: the float32 values' bytes, little-endian
    dimensions: int | None = None               # a Matryoshka model's cut (PoolingParams.dimensions)
    normalize: bool | None = None               # extension (vLLM's): None, as the server's pooler says


class ClassificationRequest(PoolingInputRequest):
    """vLLM's /classify, for a server of a sequence classifier (Qwen3ForSequenceClassification):
    each input's labels' probabilities, and its likeliest label's name."""
    use_activation: bool | None = None          # False: the raw logits; None, as the server's pooler says


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling, the generic call of a pooling model: each input's pooled output for `task`
    (vLLM's names: "embed" or "classify"; None, the model's own), with the parameters of either."""
    task: str | None = None
    use_activation: bool | None = None


class ScoreRequest(BaseModel):
    """vLLM's /score for an embedding model: the cosine similarity of text_1's embedding and each of
    text_2's (one text_1 against every text_2, or pairs of two lists of one length)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str] | list[int] | list[list[int]]
    text_2: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(BaseModel):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents ordered by their embeddings' cosine
    similarity to the query's, the best top_n of them (0: all)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str | list[int]
    documents: list[str] | list[list[int]]
    top_n: int = 0
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter; lora_int_id, where given, must be the adapter's."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """num_cached_tokens: the prompt tokens the prefix cache served, as OpenAI's
    prompt_tokens_details (given where the server was started with --enable-prompt-tokens-details)."""
    body = Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                 total_tokens=num_prompt_tokens + num_output_tokens).model_dump()
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


def completion_body(request_id: str, created: int, model: str, choices: list[dict], usage_: dict | None,
                    chunk: bool = False, chat: bool = False) -> dict:
    """created: the request's arrival, in Unix seconds, the same in every chunk of a stream."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def model_card(name: str, max_model_len: int, root: str | None = None, parent: str | None = None) -> dict:
    """vLLM's ModelCard: root the checkpoint's (or a LoRA adapter's) path, parent an adapter's base model."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mini_engine", "root": root,
            "parent": parent, "max_model_len": max_model_len}

