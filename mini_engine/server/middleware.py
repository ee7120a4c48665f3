"""What a deployment puts around the routes, as vLLM's server does: CORS (Starlette's middleware,
--allowed-origins ...), API keys (--api-key, or VLLM_API_KEY), X-Request-Id headers
(--enable-request-id-headers) and the count of requests in progress that GET /load gives
(--enable-server-load-tracking)."""
import hashlib
import hmac
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from mini_engine.server.protocol import error_response
from mini_engine.server.serving_options import ServingOptions

# Open without a key, as newer vLLM's PUBLIC_ENDPOINTS (its AuthenticationMiddleware's): probes
# (/health, SageMaker's /ping), the version, metrics scraping and the API docs. Every other path
# needs one: older vLLM guarded /v1 alone, which left /invocations, /tokenize and the pooling
# routes open.
# /load too: load balancers poll it, as they do /health.
PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/load", "/docs", "/redoc", "/openapi.json")
# The routes whose requests run on the engine: what /load counts, and what a batch line may name
# (run_batch.py, less SageMaker's /invocations).
ENGINE_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling",
                           "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                           "/invocations"})


def route_path(scope: Scope) -> str:
    """The path the routes see: less the --root-path prefix, where the server put it in front."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def is_public(path: str) -> bool:
    """A public path, or one below it (on a segment boundary: /healthz is not /health's)."""
    return any(path == public or path.startswith(public + "/") for public in PUBLIC_PATHS)


class APIKeyMiddleware:
    """A request outside PUBLIC_PATHS without `Authorization: Bearer <one of the keys>` is a 401.
    OPTIONS is let through, as vLLM's middleware lets it (no route answers it with data: a 405),
    besides the CORS preflights that the CORS middleware around this one answers first."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]):
        self.app = app
        # Digests, so that each comparison runs over the same length whatever the key's.
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def verify(self, headers: Headers) -> bool:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(key.encode()).digest()
        # Every key compared, each in constant time: timing tells neither which one matched nor how much.
        return any([hmac.compare_digest(digest, known) for known in self.digests])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS" and not is_public(route_path(scope))
                and not self.verify(Headers(scope=scope))):
            response = error_response("Unauthorized: this server needs an API key, as `Authorization: Bearer <key>`",
                                      401, code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the one the request
    sent, or a new one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass
class ServerLoad:
    """GET /load's number (vLLM's server_load_metrics): the requests in progress on ENGINE_ROUTES,
    streamed ones until their stream ends."""
    in_progress: int = 0


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad):
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in ENGINE_ROUTES:
            await self.app(scope, receive, send)
            return
        self.load.in_progress += 1
        try:
            await self.app(scope, receive, send)        # returns once the whole response (a stream too) is sent
        finally:
            self.load.in_progress -= 1


def add_middleware(app: FastAPI, options: ServingOptions, load: ServerLoad) -> None:
    """Each added is outside those before it."""
    if options.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys)
    # Outside the key check (vLLM's is inside its key check): a preflight is answered before any key
    # is asked for, and a 401 carries the CORS headers a browser needs to read it.
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials,
                       expose_headers=["X-Request-Id"] if options.enable_request_id_headers else [])
    # Outermost of ours, as vLLM's: a 401 and a CORS preflight carry one too. (An unhandled
    # exception's 500 does not: Starlette's own error middleware, outside every one added, writes it.)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
