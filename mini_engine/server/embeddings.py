"""OpenAI's /v1/embeddings response, for a server whose engine is an embedding model (--runner
pooling): each input's vector, as floats or (encoding_format "base64", as OpenAI's client asks by
default) the base64 of its little-endian float32 bytes."""
import base64
import time

import numpy as np


def encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def embedding_body(request_id: str, model: str, embeddings: list[list[float]], encoding_format: str,
                   num_prompt_tokens: int) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encoded(e, encoding_format)}
            for i, e in enumerate(embeddings)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
