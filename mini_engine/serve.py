"""`python -m mini_engine.serve --model PATH [engine options] --host 127.0.0.1 --port 8000`:
the OpenAI-compatible server. Engine options mirror EngineConfig's fields (--max-num-seqs,
--num-kv-blocks, --no-enable-prefix-caching, ...); with no --model, the embedded default
checkpoint (Qwen3-0.6B's shape, random weights, no tokenizer: prompts as token ids)."""
import argparse
import json
import logging
import os
import sys
import types
import typing
from dataclasses import MISSING, fields

from mini_engine.chat_template import compiled, load_chat_template
from mini_engine.config import OWN_SAMPLING_DEFAULTS, EngineConfig
from mini_engine.json_arguments import expand_json_arguments
from mini_engine.server.lora_modules import LoRAModulePath, parse_lora_module
from mini_engine.server.output_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ParserOptions
from mini_engine.server.serving_options import RESPONSE_ROLE, ServingOptions

# --reasoning-parser is the server's own flag below, and sets the engine's field too.
SKIPPED_FIELDS = {"model", "model_config", "reasoning_parser"}
# vLLM's short forms
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "compilation_config": ("-cc",), "optimization_level": ("-O",)}


def option_type(annotation) -> type:
    """int | None -> int, and so on: the non-None member of a union."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def engine_option_fields() -> list:
    """EngineConfig's fields that a command line sets: not the model, nor what the config derives."""
    return [f for f in fields(EngineConfig) if f.init and f.name not in SKIPPED_FIELDS]


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (EngineConfig)")
    for f in engine_option_fields():
        default = None if f.default is MISSING else f.default
        flags = ["--" + f.name.replace("_", "-"), *SHORT_FLAGS.get(f.name, ())]
        kind = option_type(f.type)
        if kind == list[int]:   # sizes, as vLLM's --cudagraph-capture-sizes 1 2 4 8
            group.add_argument(*flags, dest=f.name, nargs="+", type=int, default=default, metavar="N")
        elif kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        elif kind is dict:      # JSON, as vLLM's --hf-overrides takes it (-O 3 is JSON too: a number)
            group.add_argument(*flags, dest=f.name, type=json.loads, default=default, help="JSON")
        elif kind is list:      # names, as vLLM's --logits-processors takes them
            group.add_argument(*flags, dest=f.name, nargs="+", default=default, metavar="NAME",
                               help="qualified names (package.module:Class)")
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=default, help=f"default: {default}")


def json_option_flags() -> dict[str, str]:
    """Each option string of the engine's JSON options, to its long flag."""
    flags = {}
    for f in engine_option_fields():
        if option_type(f.type) is dict:
            long_flag = "--" + f.name.replace("_", "-")
            flags |= {flag: long_flag for flag in (long_flag, *SHORT_FLAGS.get(f.name, ()))}
    return flags


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args, with the JSON options also taken key by key, as vLLM's
    (`--speculative-config.num_speculative_tokens 4`; mini_engine/json_arguments.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # As vLLM's parser: no abbreviated flags, which the JSON options' expansion could not tell.
    parser.allow_abbrev = False
    try:
        argv = expand_json_arguments(argv, json_option_flags())
    except ValueError as e:
        parser.error(str(e))
    return parser.parse_args(argv)


def lora_module(item: str) -> LoRAModulePath:
    try:
        return parse_lora_module(item)
    except ValueError as e:     # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def chat_template_text(value: str) -> str:
    """--chat-template's template, read and compiled now: a bad path or a template that does not
    compile stops the server before it loads the model, not at the first chat request."""
    try:
        text = load_chat_template(value)
        compiled(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def json_list(value: str) -> list[str]:
    """vLLM's form for --allowed-origins and its siblings: a JSON list, '["https://a.example"]'."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, got {value}")
    return items


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """The server's options from its flags; a command without the deployment flags (the batch
    runner's) takes their defaults, no API keys and no HTTPS."""
    deployed = {}
    if hasattr(args, "api_key"):
        # As vLLM's build_app: --api-key wins over VLLM_API_KEY, and an empty key is none.
        deployed = dict(
            api_keys=tuple(key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key),
            allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs, enable_request_id_headers=args.enable_request_id_headers,
            enable_server_load_tracking=args.enable_server_load_tracking, root_path=args.root_path,
            disable_fastapi_docs=args.disable_fastapi_docs, disable_uvicorn_access_log=args.disable_uvicorn_access_log)
    return ServingOptions(
        chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, data_parallel_size=args.data_parallel_size,
        response_role=args.response_role, disable_log_stats=args.disable_log_stats,
        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len, **deployed)


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or "qwen3-0.6b-random"


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """What the server and the batch runner (run_batch.py) share: the model, how requests are
    rendered and parsed, and the engine's options."""
    parser.add_argument("--model", default=None, help="a Hugging Face Qwen3 checkpoint folder "
                        "(default: the embedded random Qwen3-0.6B)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # As vLLM's flags (and off by default, as there): `vllm serve Qwen/Qwen3-0.6B --reasoning-parser qwen3
    # --enable-auto-tool-choice --tool-call-parser hermes` runs here as it is.
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="chat responses give Qwen3's <think> text apart, in `reasoning`, and "
                        "structured outputs hold only what follows it")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="chat responses give the model's calls as `tool_calls`: hermes reads Qwen3's "
                        "<tool_call> blocks of JSON, qwen3_coder Qwen3-Coder's <function=...> XML")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accept requests with tools (tool_choice \"auto\"); needs --tool-call-parser")
    # As vLLM's: adapters served under their names (the request's `model`), each read and checked
    # by the engine before the server is ready; --enable-lora, --max-loras, --max-lora-rank and
    # --max-cpu-loras are EngineConfig's (below). Repeated, the flag adds to the list.
    parser.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=[],
                        metavar="name=path", help='LoRA adapters (PEFT folders) as name=path, or as JSON '
                        '{"name": ..., "path": ..., "base_model_name": ...}; needs --enable-lora')
    # As vLLM's: the template chat requests render with, in place of the checkpoint's (or where it
    # has none); and whether a request may send its own (`chat_template`), off by default as a
    # template is code the server runs.
    parser.add_argument("--chat-template", type=chat_template_text, default=None, metavar="PATH_OR_TEMPLATE",
                        help="a Jinja chat template's file, or the template itself (a value with {, } or a newline)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a request's own chat_template (else a 400)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs name each token "token_id:{id}" (a request\'s return_tokens_as_token_ids wins)')
    parser.add_argument("--response-role", default=RESPONSE_ROLE,
                        help="the role of a chat answer that opens a new turn (add_generation_prompt)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, running and waiting requests, KV cache usage) "
                        "in the log; VLLM_LOG_STATS_INTERVAL sets its period, 10 s")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="a log line for each request: its id, sampling params and prompt token ids")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests: at most this many prompt token ids a line (default: all)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine processes, each with the whole model on its own GPUs (tensor-parallel-size "
                        "each), requests shared among them")
    add_engine_options(parser)


def add_deployment_options(parser: argparse.ArgumentParser) -> None:
    """The server's alone: where it listens, who may call it. As vLLM's flags, names and defaults."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                        help="requests need `Authorization: Bearer KEY`, one of these (default: VLLM_API_KEY's "
                        "value, if set), except /health, /ping, /version, /metrics, /load and the docs")
    for what in ("origins", "methods", "headers"):
        parser.add_argument(f"--allowed-{what}", type=json_list, default=["*"], metavar="JSON_LIST",
                            help=f'CORS: the allowed {what}, as a JSON list (default: ["*"])')
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--ssl-keyfile", default=None, help="HTTPS: the key file")
    parser.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file")
    parser.add_argument("--ssl-ca-certs", default=None, help="HTTPS: the CA certificates file")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="whether a client certificate is required (the ssl module's: 0 none, 2 required)")
    parser.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (uvicorn's)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="each response carries X-Request-Id: the request's own, or a new one")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="GET /load counts the generating and pooling requests in progress (else 0)")
    parser.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line a request")


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    names = [module.name for module in args.lora_modules]
    if duplicates := sorted({name for name in names if names.count(name) > 1}):
        parser.error(f"--lora-modules names each adapter once: {duplicates} given more than once")
    if served_name(args) in names:
        parser.error(f"--lora-modules: the adapter name {served_name(args)!r} is the served model's name")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mini_engine.serve", description=__doc__.split("\n\n")[0])
    add_deployment_options(parser)
    add_model_options(parser)
    args = parse_command_line(parser, argv)
    check_model_options(parser, args)
    if args.ssl_keyfile and not args.ssl_certfile:       # else uvicorn fails, once the model has loaded
        parser.error("--ssl-keyfile needs --ssl-certfile")
    return args


def build_served_app(args: argparse.Namespace):
    """The app that serves args' model (its engine process started and ready), and the options
    it was built with; the server and the batch runner both run this."""
    from mini_engine.model.random_checkpoint import default_checkpoint
    from mini_engine.server.app import build_app
    from mini_engine.server.stats_logger import log_stats_interval

    if not args.disable_log_stats:
        log_stats_interval()        # a bad VLLM_LOG_STATS_INTERVAL stops the server before the model loads
    model = args.model or default_checkpoint()
    name = served_name(args)
    options = {f.name: getattr(args, f.name) for f in engine_option_fields()}
    config = EngineConfig.from_kwargs(model, reasoning_parser=args.reasoning_parser, **options)
    parsers = ParserOptions(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    serving = serving_options(args)
    app = build_app(config, name, parsers, args.lora_modules, serving)
    log = logging.getLogger("mini_engine.server")
    limits = app.state.server.async_engine.limits
    log.info("serving %s as %r: %d KV blocks of %d tokens%s, max_model_len %d", model, name, limits.num_blocks,
             limits.block_size, f" in each of {serving.data_parallel_size} engines" if serving.data_parallel_size > 1
             else "", limits.max_model_len)
    if args.chat_template is not None:
        log.info("chat requests render with --chat-template's template, in place of the checkpoint's")
    for module in args.lora_modules:
        log.info("serving LoRA adapter %s as %r", module.path, module.name)
    if config.sampling_defaults:
        overridden = sorted(config.override_generation_config or {})
        source = ("nothing else" if config.generation_config in OWN_SAMPLING_DEFAULTS else
                  f"{model if config.generation_config == 'auto' else config.generation_config}'s generation_config.json")
        log.info("requests that leave them unset sample with %s (%s%s)", config.sampling_defaults,
                 f"{overridden} from --override-generation-config, the rest from " if overridden else "from ", source)
    if config.max_new_tokens is not None:
        log.info("no request generates more than max_new_tokens=%d tokens (generation_config's)", config.max_new_tokens)
    return app, serving


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    app, serving = build_served_app(args)
    if serving.api_keys:
        logging.getLogger("mini_engine.server").info("requests need one of %d API keys", len(serving.api_keys))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                **serving.uvicorn_options())


if __name__ == "__main__":
    main()
