"""What a deployment puts around the routes, as vLLM's server does: CORS (Starlette's middleware,
--allowed-origins ...) and API keys (--api-key, or VLLM_API_KEY)."""
import hashlib
import hmac

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
PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json")


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
        if (scope["type"] == "http" and scope["method"] != "OPTIONS" and not is_public(scope["path"])
                and not self.verify(Headers(scope=scope))):
            response = error_response("Unauthorized: this server needs an API key, as `Authorization: Bearer <key>`",
                                      401, code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def add_middleware(app: FastAPI, options: ServingOptions) -> None:
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys)
    # Added last, so outermost (vLLM's is inside its key check): a preflight is answered before any
    # key is asked for, and a 401 carries the CORS headers a browser needs to read it.
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials)
