"""SageMaker's POST /invocations, as vLLM routes it (vllm/entrypoints/sagemaker/api_router.py): one
route for every request, sent to the first endpoint, of those this server's model serves, whose
request shape the body fits (the request models forbid unknown fields, so the shapes differ).
Its GET/POST /ping is /health (app.py)."""
import json
from typing import Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response

from mini_engine.server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                                         EmbeddingRequest, PoolingRequest, ProtocolError, RerankRequest,
                                         ScoreRequest)

Endpoint = Callable[[pydantic.BaseModel, Request], Awaitable[Response]]


def invocation_types(server, pooling) -> list[tuple[type[pydantic.BaseModel], Endpoint]]:
    """vLLM's order (get_generate_invocation_types, then get_pooling_invocation_types), each kept
    where its endpoint would serve it rather than refuse it. server: the OpenAIServer; pooling:
    its PoolingEndpoints."""
    if server.config.runner != "pooling":
        return [(ChatCompletionRequest, server.chat_completions), (CompletionRequest, server.completions)]
    served = [] if pooling.cross_encoder else [(EmbeddingRequest, pooling.embeddings)]
    if pooling.classifier:
        served.append((ClassificationRequest, pooling.classify))
    return served + [(RerankRequest, pooling.rerank), (ScoreRequest, pooling.score), (PoolingRequest, pooling.pooling)]


def add_invocations_route(app: FastAPI, server, pooling) -> None:
    shapes = invocation_types(server, pooling)

    @app.post("/invocations")
    async def invocations(raw: Request):
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProtocolError(f"JSON decode error: {e}") from None
        for request_type, endpoint in shapes:
            try:
                req = request_type.model_validate(body)
            except pydantic.ValidationError:
                continue
            return await endpoint(req, raw)
        raise ProtocolError("Cannot find suitable handler for request. Expected one of: "
                            f"{[request_type.__name__ for request_type, _ in shapes]}")
