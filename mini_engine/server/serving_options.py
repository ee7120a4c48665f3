"""The server's own options (vLLM's serving flags), beside the engine's (EngineConfig) and the
output parsers' (output_parsers.ParserOptions)."""
from dataclasses import dataclass

# vLLM's --response-role default: the role of a chat answer that opens a new turn.
RESPONSE_ROLE = "assistant"


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
    # --return-tokens-as-token-ids: logprobs name each token "token_id:{id}" where a request leaves
    # its own return_tokens_as_token_ids unset, so that a token whose text is no whole character
    # (a piece of a multi-byte one) can still be told apart.
    return_tokens_as_token_ids: bool = False
    # --api-key (else VLLM_API_KEY): every route but middleware.PUBLIC_PATHS needs one of these as
    # `Authorization: Bearer <key>`; none, no check.
    api_keys: tuple[str, ...] = ()
    # --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials: CORS, as vLLM's.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs: HTTPS, by uvicorn (serve.py);
    # ssl_cert_reqs is the ssl module's (0 CERT_NONE, 2 CERT_REQUIRED: clients show a certificate
    # that ssl_ca_certs signed).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # --response-role: the role of a chat answer that opens a new turn (add_generation_prompt).
    response_role: str = RESPONSE_ROLE
    # --enable-request-id-headers: each response carries X-Request-Id, the request's own or a new one.
    enable_request_id_headers: bool = False
    # --enable-server-load-tracking: GET /load counts the requests in progress on the generating and
    # pooling routes (load balancers poll it); without, it answers 0, as vLLM's.
    enable_server_load_tracking: bool = False
    # --root-path (uvicorn's): the path prefix a proxy serves the API under.
    root_path: str = ""
    # --disable-fastapi-docs: no /docs, /redoc or /openapi.json.
    disable_fastapi_docs: bool = False
    # --disable-uvicorn-access-log: no log line a request.
    disable_uvicorn_access_log: bool = False
    # --data-parallel-size (vLLM's -dp): engine processes, each with the whole model on GPUs of its
    # own, requests shared among them (server/data_parallel.py).
    data_parallel_size: int = 1
    # --disable-log-stats: no periodic stats line in the log (server/stats_logger.py), which vLLM's
    # servers write every VLLM_LOG_STATS_INTERVAL seconds while they work.
    disable_log_stats: bool = False
    # --enable-log-requests: a log line for each request the engine is sent (its id, params and
    # prompt token ids, at most --max-log-len of them: None, all), as vLLM's.
    enable_log_requests: bool = False
    max_log_len: int | None = None

    def uvicorn_options(self) -> dict:
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs, "root_path": self.root_path,
                "access_log": not self.disable_uvicorn_access_log}
