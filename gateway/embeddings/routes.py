"""``POST /v1/embeddings``, as the ``openai`` client's ``client.embeddings.create`` speaks it.

    parse + validate --> the model's embed pool (none: 404 / 503) --> tokenize --> limits (400)
        --> priority (x-priority, clamped by the key) --> acquire (429)
        --> cut the inputs into parts under the bus's max_payload
        --> each part to an embed worker (``EmbedRouter``: least in flight; another on no answer)
        --> join the vectors in order --> float lists or base64 (little-endian float32)
    release: once, in a ``finally``

Embed workers (``mesh worker decode --task embed``, role ``embed``) are a pool of their own: this
route sends only to them, and the completion routes never see them. The route sits behind the
API keys and the body cap like every other (``gateway.auth.guard``); a caller in the same process
(the Batch API) posts to it as ASGI with ``scope["state"]["api_key"]`` set, as the guard does.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Literal

import nats.errors
import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway import errors
from gateway.errors import APIError
from gateway.requests.bodies import parse_body
from gateway.requests.schemas import TokenId, openapi_body
from gateway.service import Gateway
from gateway.tenancy import clamp_priority, header_priority
from mesh.protocol import DecodeError, EmbedReply, EmbedRequest, WorkerCard
from mesh.router.embed import EmbedRouter
from mesh.telemetry import tracer
from mesh.tracing import context_from

log = logging.getLogger(__name__)
TRACER = tracer("pdmesh.gateway")

MAX_INPUTS = 2048  # OpenAI's bound on the array
LONG_INPUT_CHARS = 16_384  # tokenize longer inputs in a thread
ENVELOPE_BYTES = 4096  # room for a message's other fields under max_payload
TOKEN_BYTES = 5  # a token id in msgpack, at most
PROMPT_BYTES = 5  # a prompt's list header


class EmbeddingRequest(BaseModel):
    """As ``gateway.schemas``' bodies: unknown fields ignored, strict types, every number bounded."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=1 << 16)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str):
            v = [v]
        if not v:
            raise ValueError("input must not be empty")
        if len(v) > MAX_INPUTS and not isinstance(v[0], int):  # a list of ids is one input
            raise ValueError(f"input holds at most {MAX_INPUTS} items")
        if any(isinstance(x, str | list) and not x for x in v):
            raise ValueError("input must not hold an empty string or an empty token list")
        return v

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids (a flat list of ids is one input)."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]
        return list(v)


def install_embedding_routes(app: FastAPI, gateway: Gateway) -> None:
    """``POST /v1/embeddings`` on ``app`` (one line in ``gateway.app.create_app``)."""
    service = Embeddings(gateway)

    @app.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
    async def embeddings(request: Request):
        return await service.handle(request)


class Embeddings:
    """The route's work: the embed pool of each model, parts in flight, the response."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self._router: EmbedRouter | None = None

    @property
    def router(self) -> EmbedRouter:
        if self._router is None:  # the membership exists once the gateway has started
            self._router = EmbedRouter(self.gw.membership)
        return self._router

    async def handle(self, request: Request) -> Response:
        """The request in its server span, its status counted (``embeddings``)."""
        parent = context_from(dict(request.headers)) if self.gw.tracing else None
        with TRACER.start_as_current_span("POST /v1/embeddings", context=parent, kind=trace.SpanKind.SERVER,
                                          attributes={"http.request.method": "POST",
                                                      "http.route": "/v1/embeddings"}) as span:
            try:
                response = await self._embed(request)
            except APIError as e:
                response = e.response()
            except Exception:
                log.exception("unhandled error on /v1/embeddings")
                response = APIError(500, "internal error").response()
            span.set_attribute("http.response.status_code", response.status_code)
        self.gw.stats.request("embeddings", response.status_code)
        return response

    async def _embed(self, request: Request) -> Response:
        body, _ = await parse_body(request, EmbeddingRequest)
        model = body.model
        workers = self._workers(model)
        prompts = await self._tokenize(model, body.inputs())
        self._check_limits(model, workers, prompts)
        dim = workers[0].embed_dim or 1
        if body.dimensions is not None and body.dimensions > dim:
            raise APIError(400, f"dimensions {body.dimensions} is more than this model's {dim}", "dimensions")
        priority = _priority(request)
        rid = f"embd-{uuid.uuid4().hex}"
        self.gw.acquire(1)
        try:
            parts = split_inputs(prompts, body.dimensions or dim, self.gw.bus.max_payload)
            sends = [asyncio.ensure_future(self._send(rid, model, part, body.dimensions or 0, priority))
                     for part in parts]
            try:
                replies = await asyncio.gather(*sends)
            except BaseException:  # a part failed, or the request was cancelled: the other parts stop
                for task in sends:
                    task.cancel()
                raise
        finally:
            self.gw.release(1)
        vectors = [v for reply in replies for v in _rows(reply)]
        tokens = sum(len(p) for p in prompts)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        payload = {"object": "list", "data": data, "model": model,
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json",
                        headers={"x-request-id": rid})

    def _workers(self, model: str) -> list[WorkerCard]:
        """The model's ready embed workers; 404 for a model nobody serves, 503 for one served
        without embed workers (or whose embed workers are all gone)."""
        workers = self.router.workers(model)
        if workers:
            return workers
        gw = self.gw
        if model in gw.live_models() or model in gw.tokenizers or gw.membership.served_recently(model):
            raise APIError(503, f"no embed worker serves model {model!r}: start one with "
                                "`mesh worker decode --task embed` (or `mesh up --embed-workers N`)", "model")
        raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")

    async def _tokenize(self, model: str, inputs: list[str | list[int]]) -> list[list[int]]:
        texts = [x for x in inputs if isinstance(x, str)]
        if not texts:
            return inputs  # token ids: no work
        tok = self.gw.require_tokenizer(model, "input")
        size = sum(len(t) for t in texts)
        encoded = tok.encode_batch(texts) if size < LONG_INPUT_CHARS else await asyncio.to_thread(tok.encode_batch, texts)
        it = iter(encoded)
        prompts = [next(it) if isinstance(x, str) else x for x in inputs]
        if any(not p for p in prompts):
            raise APIError(400, "an input tokenizes to no tokens", "input")
        return prompts

    def _check_limits(self, model: str, workers: list[WorkerCard], prompts: list[list[int]]) -> None:
        limit = min(c.max_model_len for c in workers)
        longest = max(len(p) for p in prompts)
        if longest > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, an input has "
                                f"{longest} tokens. Please reduce the length of the input.", "input",
                           "context_length_exceeded")
        tok = self.gw.tokenizer(model)
        if tok is not None:
            bad = next((t for p in prompts for t in p if t >= tok.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", "input")

    async def _send(self, rid: str, model: str, part: list[list[int]], dimensions: int,
                    priority: int = 0) -> EmbedReply:
        """One part to an embed worker; on no answer (gone, draining, silent) to another, each
        worker tried once. Worker errors pass through (``errors.upstream``)."""
        tried: set[str] = set()
        timeout = self.gw.config.first_token_timeout
        last = "no embed worker answered"
        while True:
            try:
                card = self.router.pick(model, tried)
            except LookupError:
                raise APIError(503, f"{last} for model {model!r}") from None
            tried.add(card.worker_id)
            subject = self.gw.bus.subjects.embed(model, card.worker_id)
            self.router.started(card.worker_id)
            started = time.monotonic()
            try:
                msg = EmbedRequest(rid, model, part, dimensions, priority)
                reply = await self.gw.bus.request(subject, msg, EmbedReply, timeout)
            except (TimeoutError, nats.errors.Error) as e:
                self.router.suspect(card.worker_id)
                last = f"embed worker {card.worker_id} did not answer ({type(e).__name__})"
                log.warning("%s: %s after %.1fs", rid, last, time.monotonic() - started)
                continue
            except DecodeError as e:
                raise APIError(502, f"the embed worker sent a malformed reply: {e}") from None
            finally:
                self.router.finished(card.worker_id)
            if reply.error_status == 503:  # draining: another worker takes it
                self.router.suspect(card.worker_id)
                last = reply.error
                continue
            if reply.error:
                e = errors.upstream(reply.error_status, reply.error)
                e.param = "dimensions" if dimensions and "dimensions" in reply.error else "input"
                raise e
            if len(reply.vectors) != 4 * reply.dim * len(part) or reply.dim < 1:
                raise APIError(502, "the embed worker sent vectors of the wrong size")
            return reply


def split_inputs(prompts: list[list[int]], dim: int, max_payload: int) -> list[list[list[int]]]:
    """Consecutive runs of ``prompts`` whose ``EmbedRequest`` and ``EmbedReply`` (``dim`` float32
    each) both fit in ``max_payload``; a prompt always goes, alone if it must."""
    room = max(1024, max_payload - ENVELOPE_BYTES)
    parts: list[list[list[int]]] = [[]]
    request = 0
    for p in prompts:
        size = PROMPT_BYTES + TOKEN_BYTES * len(p)
        if parts[-1] and (request + size > room or 4 * dim * (len(parts[-1]) + 1) > room):
            parts.append([])
            request = 0
        parts[-1].append(p)
        request += size
    return parts


def _priority(request: Request) -> int:
    """The ``x-priority`` header (interactive, batch or an integer; the Batch API sends its lines'),
    as far as the request's API key may ask (``clamp_priority``)."""
    value = header_priority(request.headers.get("x-priority", ""))
    return clamp_priority(value, request.scope.get("state", {}).get("api_key"))


def _rows(reply: EmbedReply) -> list[np.ndarray]:
    return list(np.frombuffer(reply.vectors, dtype="<f4").reshape(-1, reply.dim))


def _encoded(vector: np.ndarray, encoding: str) -> np.ndarray | str:
    """``float``: the vector (orjson writes it as a list of numbers); ``base64``: the little-endian float32 bytes, as the openai
    client decodes them (``np.frombuffer(base64.b64decode(s), dtype="float32")``)."""
    if encoding == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector
