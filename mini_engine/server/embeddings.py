"""The endpoints of a server whose engine is a pooling model (--runner pooling): OpenAI's
/v1/embeddings, vLLM's /classify (a sequence classifier's labels' probabilities), vLLM's /pooling
(either, as the task asks), and vLLM's /score and /rerank, which score texts against texts: an
embedding model by the cosine similarity of their embeddings (as vLLM's score API does for one), a
cross-encoder (classifier_from_token: Qwen3-Reranker, or a sequence classifier of one label) by its
score of each pair read as one prompt. /v1/embeddings, /classify and /pooling take chat `messages`
in place of `input`, as vLLM's. Each request's prompts run as one batch of engine requests; a
client that leaves has them aborted."""
import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mini_engine.layers.pooler import cosine_similarity, task_output
from mini_engine.pooling_params import PoolingParams, check_task_parameters, resolve_pooling_task, truncate_prompt
from mini_engine.tokenizer import encode_pair
from mini_engine.server.protocol import (ChatCompletionRequest, ClassificationRequest, EmbeddingRequest,
                                         PoolingInputRequest, PoolingRequest, ProtocolError, RerankRequest,
                                         ScoreRequest, error_response, random_id)


def encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """A vector as floats, or (encoding_format "base64", as OpenAI's client asks by default) the
    base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def usage(num_prompt_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}


class PoolingEndpoints:
    def __init__(self, server):
        """server: the OpenAIServer, whose checks, tokenizer and engine these share."""
        self.server = server

    def params(self, runner_needed_by: str, model: str | None, priority: int, **fields) -> PoolingParams:
        server = self.server
        server.check_model(model)
        if server.config.runner != "pooling":
            classifier = ("a sequence classifier's checkpoint, Qwen3ForSequenceClassification, for which the default "
                          "--runner auto picks it")
            embedding = "an embedding model, such as Qwen3-Embedding"
            model = {"/classify": classifier, "/pooling": f"{embedding}, or {classifier}"}.get(runner_needed_by,
                                                                                               embedding)
            raise ProtocolError(f"this server runs a generative model: {runner_needed_by} needs a server started "
                                f"with --runner pooling ({model})")
        server.check_priority(priority)
        try:
            return PoolingParams(**fields)
        except ValueError as e:     # the message starts with the parameter's name
            raise ProtocolError(str(e), param=str(e).split(" ", 1)[0]) from None

    @property
    def classifier(self) -> bool:
        """A sequence classifier (Qwen3ForSequenceClassification): /classify, and /score and /rerank with one label."""
        return self.server.config.pooler.is_classifier

    @property
    def cross_encoder(self) -> bool:
        """Whether /score and /rerank read each pair as one prompt (a cross-encoder's, or a
        classifier's of one label) rather than compare two embeddings."""
        return self.server.config.pooler.is_cross_encoder or self.classifier

    def check_scores_pairs(self, endpoint: str) -> None:
        """As vLLM's: a classifier scores pairs only where it has one label."""
        num_labels = self.server.config.model_config.num_labels
        if self.classifier and num_labels != 1:
            raise ProtocolError(f"{endpoint} needs a classifier of one label (num_labels == 1, as vLLM's Score API); "
                                f"this one has {num_labels}: /classify")

    def prompts(self, inputs: list[tuple[str, str | list[int]]], add_special_tokens: bool = True) -> list[list[int]]:
        """The inputs, (name for errors, text or token ids), as token ids."""
        return [self.server.tokenize(text, name, add_special_tokens, name.split(" ")[0]) for name, text in inputs]

    def input_prompts(self, req: PoolingInputRequest) -> list[list[int]]:
        """A request's prompts as token ids: its input's (text with the tokenizer's special tokens
        unless add_special_tokens says otherwise), or its messages' one prompt, rendered by the chat
        template as /v1/chat/completions and /tokenize render them (without the tokenizer's special
        tokens unless asked: the template writes a chat's own)."""
        if (req.input is None) == (req.messages is None):
            raise ProtocolError("give either input or messages" if req.input is None else
                                "give input or messages, not both", param="input")
        if req.messages is None:
            texts = self.server.prompt_list(req.input)
            names = [f"input {i}" if len(texts) > 1 else "input" for i in range(len(texts))]
            return self.prompts(list(zip(names, texts)), req.add_special_tokens is not False)
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
        text, _ = self.server.render_chat(chat)
        return self.prompts([("messages", text)], req.add_special_tokens is True)

    def pairs(self, first: list, second: list) -> list[list[int]]:
        """A cross-encoder's prompts: first's (one for all, or one each) and second's texts, paired."""
        try:
            return [encode_pair(self.server.tokenizer, first[0 if len(first) == 1 else i], b)
                    for i, b in enumerate(second)]
        except ValueError as e:
            raise ProtocolError(str(e)) from None

    async def embed(self, raw: Request, request_id: str, prompts: list[list[int]], params: PoolingParams,
                    priority: int, respond) -> Response:
        """Runs the prompts, and answers respond(pooled outputs, prompt tokens)'s body."""
        server = self.server
        prompts = [truncate_prompt(p, params, server.config.max_model_len) for p in prompts]
        streams = server.add(request_id, prompts, params, priority)

        async def collect() -> Response:
            vectors = []
            for stream in streams:
                async for delta in stream:
                    if delta.finish_reason == "error":
                        return error_response(delta.error or "the request failed", 500)
                vectors.append(delta.embedding)
            return JSONResponse(respond(vectors, sum(map(len, prompts))))
        return await server.unless_disconnected(raw, collect(), streams)

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> Response:
        params = self.params("/v1/embeddings", req.model, req.priority, dimensions=req.dimensions,
                             normalize=req.normalize, truncate_prompt_tokens=req.truncate_prompt_tokens)
        if self.classifier:
            raise ProtocolError("this server runs a sequence classifier (Qwen3ForSequenceClassification), not an "
                                "embedding model: /classify")
        if self.cross_encoder:
            raise ProtocolError("this server runs a cross-encoder (classifier_from_token): it scores pairs, "
                                "/score and /rerank")
        request_id = random_id("embd")

        def respond(vectors: list[list[float]], num_tokens: int) -> dict:
            data = [{"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
                    for i, v in enumerate(vectors)]
            return self.listed(request_id, data, num_tokens)
        return await self.embed(raw, request_id, self.input_prompts(req), params, req.priority, respond)

    def listed(self, request_id: str, data: list[dict], num_tokens: int) -> dict:
        """The body vLLM's embedding, classification and pooling responses share."""
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.server.model_name,
                "data": data, "usage": usage(num_tokens)}

    async def pooling(self, req: PoolingRequest, raw: Request) -> Response:
        """vLLM's /pooling: each input's pooled output for the task (the model's own where the
        request names none), `data` as LLM.encode's: an embedding, a classifier's probabilities (raw
        logits with use_activation false), a cross-encoder's score."""
        params = self.params("/pooling", req.model, req.priority, dimensions=req.dimensions, normalize=req.normalize,
                             truncate_prompt_tokens=req.truncate_prompt_tokens, use_activation=req.use_activation)
        pooler = self.server.config.pooler
        try:
            task = resolve_pooling_task(req.task, pooler)
        except ValueError as e:
            raise ProtocolError(str(e), param="task") from None
        try:
            check_task_parameters(params, task, pooler)
        except ValueError as e:     # the message starts with the parameter's name
            raise ProtocolError(str(e), param=str(e).split(" ", 1)[0].split("=")[0]) from None
        request_id = random_id("pool")

        def respond(outputs: list[list[float]], num_tokens: int) -> dict:
            data = [{"index": i, "object": "pooling", "data": encoded(task_output(out, pooler), req.encoding_format)}
                    for i, out in enumerate(outputs)]
            return self.listed(request_id, data, num_tokens)
        return await self.embed(raw, request_id, self.input_prompts(req), params, req.priority, respond)

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        params = self.params("/score", req.model, req.priority, truncate_prompt_tokens=req.truncate_prompt_tokens)
        self.check_scores_pairs("/score")
        first, second = self.server.prompt_list(req.text_1), self.server.prompt_list(req.text_2)
        if len(first) != 1 and len(first) != len(second):
            raise ProtocolError(f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or "
                                "as many as text_2", param="text_1")
        request_id = random_id("score")
        if self.cross_encoder:
            prompts = self.pairs(first, second)
        else:
            prompts = self.prompts([(f"text_1 {i}", t) for i, t in enumerate(first)]
                                   + [(f"text_2 {i}", t) for i, t in enumerate(second)])

        def respond(vectors: list[list[float]], num_tokens: int) -> dict:
            scores = self.scores(vectors, len(first))
            return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.server.model_name,
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    "usage": usage(num_tokens)}
        return await self.embed(raw, request_id, prompts, params, req.priority, respond)

    def scores(self, outputs: list[list[float]], num_first: int) -> list[float]:
        """Each pair's score: a cross-encoder's outputs are its pairs' classifier probabilities (the
        score the last; a classifier's one label's sigmoid); an embedding model's, the first texts'
        embeddings then the second's."""
        if self.cross_encoder:
            return [probabilities[-1] for probabilities in outputs]
        left, right = outputs[:num_first], outputs[num_first:]
        return [cosine_similarity(left[0 if len(left) == 1 else i], v) for i, v in enumerate(right)]

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        params = self.params("/rerank", req.model, req.priority, truncate_prompt_tokens=req.truncate_prompt_tokens)
        self.check_scores_pairs("/rerank")
        if not req.documents:
            raise ProtocolError("documents is empty", param="documents")
        if req.top_n < 0:
            raise ProtocolError(f"top_n must be >= 0 (0: every document), got {req.top_n}", param="top_n")
        request_id = random_id("rerank")
        if self.cross_encoder:
            prompts = self.pairs([req.query], req.documents)
        else:
            prompts = self.prompts([("query", req.query)] + [(f"documents {i}", d) for i, d in enumerate(req.documents)])

        def respond(vectors: list[list[float]], num_tokens: int) -> dict:
            scores = self.scores(vectors, 1)
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
            results = [{"index": i, "relevance_score": scores[i]} | (
                {"document": {"text": req.documents[i]}} if req.return_documents and isinstance(req.documents[i], str)
                else {}) for i in order]
            return {"id": request_id, "model": self.server.model_name, "usage": {"total_tokens": num_tokens},
                    "results": results}
        return await self.embed(raw, request_id, prompts, params, req.priority, respond)

    async def classify(self, req: ClassificationRequest, raw: Request) -> Response:
        """vLLM's /classify: each input's probabilities (its raw logits with use_activation false),
        and the name (config.json's id2label) of the likeliest label, as vLLM labels it."""
        params = self.params("/classify", req.model, req.priority, truncate_prompt_tokens=req.truncate_prompt_tokens,
                             use_activation=req.use_activation)
        if not self.classifier:
            raise ProtocolError("/classify needs a sequence classifier (config.json's architectures "
                                "Qwen3ForSequenceClassification); this server runs "
                                + ("a cross-encoder (classifier_from_token): /score and /rerank"
                                   if self.cross_encoder else "an embedding model: /v1/embeddings"))
        labels = self.server.config.model_config.labels
        request_id = random_id("classify")

        def respond(outputs: list[list[float]], num_tokens: int) -> dict:
            data = [{"index": i, "label": labels[int(np.argmax(probs))], "probs": probs, "num_classes": len(probs)}
                    for i, probs in enumerate(outputs)]
            return self.listed(request_id, data, num_tokens)
        return await self.embed(raw, request_id, self.input_prompts(req), params, req.priority, respond)
