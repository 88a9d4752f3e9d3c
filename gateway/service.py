"""The gateway's work, HTTP aside: models, tokenizers, routing, one choice's token stream.

``Gateway`` owns the bus connection and the registry view. ``stream_choice``
turns a prompt into a stream of ``ChoiceDelta``s: it picks a worker, streams
its ``TokenChunk``s, detokenizes incrementally, applies stop strings, and
cancels the request on the worker when the client goes away or a stop string
ends it early.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.detok import IncrementalDetokenizer, StopMatcher
from gateway.errors import APIError
from mesh import client
from mesh.bus import Bus
from mesh.protocol import GenerateRequest, SamplingOptions, TokenLogprobs, Usage, WorkerCard
from mesh.registry import Membership
from mesh.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str
    ns: str = "mesh"
    host: str = "0.0.0.0"
    port: int = 8000
    model_dirs: tuple[str, ...] = ()  # tokenizers and chat templates come from here
    served_names: tuple[str, ...] = ()  # names for model_dirs (default: directory names)
    max_inflight: int = 1024  # admitted requests at once; beyond it: 429
    default_max_tokens: int = 1024
    first_token_timeout: float = 120.0
    idle_timeout: float = 60.0
    retries: int = 2  # re-pick a worker when one is draining or vanished before answering


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.tokenizers: dict[str, Tokenizer] = {}
        for i, d in enumerate(config.model_dirs):
            name = config.served_names[i] if i < len(config.served_names) else Path(d).name
            self.tokenizers[name] = Tokenizer(d)
        self.bus: Bus | None = None
        self.membership: Membership | None = None
        self.inflight = 0
        self._rr = itertools.count()
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.bus = await Bus.connect(self.config.nats_url, name="gateway", ns=self.config.ns)
        self.membership = Membership(self.bus)
        await self.membership.start(wait=2.0)

    async def stop(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self.membership:
            await self.membership.stop()
        if self.bus:
            await self.bus.close()

    # -- models and workers -----------------------------------------------------------
    def decode_workers(self, model: str) -> list[WorkerCard]:
        return [c for c in self.membership.cards(model, "decode") if c.status == "ready"]

    def live_models(self) -> list[str]:
        return sorted({c.model for c in self.membership.cards(role="decode")})

    def check_model(self, model: str) -> None:
        if model not in self.live_models():
            if model in self.tokenizers:
                raise APIError(503, f"no live worker serves model {model!r}")
            raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")

    def tokenizer(self, model: str) -> Tokenizer | None:
        return self.tokenizers.get(model)

    def require_tokenizer(self, model: str) -> Tokenizer:
        tok = self.tokenizers.get(model)
        if tok is None:
            raise APIError(400, f"this gateway has no tokenizer for {model!r}: send token ids", "prompt")
        return tok

    def max_model_len(self, model: str) -> int:
        lens = [c.max_model_len for c in self.membership.cards(model, "decode")]
        return min(lens) if lens else 0

    def pick_worker(self, model: str, token_ids: list[int], exclude: set[str]) -> WorkerCard:
        """Round-robin over the model's ready decode workers (the KV router replaces this)."""
        workers = [w for w in self.decode_workers(model) if w.worker_id not in exclude]
        if not workers:
            raise APIError(503, f"no live worker for model {model!r}")
        workers.sort(key=lambda w: w.worker_id)
        return workers[next(self._rr) % len(workers)]

    # -- admission ----------------------------------------------------------------------
    def acquire(self, n: int) -> None:
        """Admit ``n`` choices or raise 429; every acquire is paired with a ``release``."""
        if self.inflight + n > self.config.max_inflight:
            raise APIError(429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"})
        self.inflight += n

    def release(self, n: int) -> None:
        self.inflight -= n

    # -- one choice -----------------------------------------------------------------------
    async def stream_choice(
        self, index: int, request_id: str, model: str, prompt_ids: list[int],
        sampling: SamplingOptions, stops: list[str], priority: int = 0,
    ) -> AsyncIterator[ChoiceDelta]:
        tok = self.tokenizer(model)
        detok = IncrementalDetokenizer(tok) if tok else None
        stop = StopMatcher(stops)
        req = GenerateRequest(request_id, model, prompt_ids, sampling, priority, time.time())
        tried: set[str] = set()
        worker = None
        finished = False
        usage: Usage | None = None
        completion = 0
        try:
            for attempt in range(self.config.retries + 1):
                worker = self.pick_worker(model, prompt_ids, tried)
                tried.add(worker.worker_id)
                retry = False
                async for chunk in client.generate(
                    self.bus, worker.worker_id, req, self.config.first_token_timeout, self.config.idle_timeout
                ):
                    if chunk.error:
                        finished = True
                        if chunk.error_status == 503 and attempt < self.config.retries:
                            retry = True  # draining: try another worker
                            break
                        raise APIError(chunk.error_status or 500, chunk.error)
                    completion += len(chunk.token_ids)
                    usage = chunk.usage or usage
                    text = detok.push(chunk.token_ids) if detok else ""
                    if chunk.finish_reason is not None:
                        finished = True
                        if detok:
                            text += detok.flush()
                    out = stop.feed(text)
                    if stop.stopped:
                        yield ChoiceDelta(index, out, chunk.token_ids, chunk.logprobs, "stop",
                                          _usage(usage, len(prompt_ids), completion))
                        return
                    if chunk.finish_reason is not None:
                        out += stop.flush()
                    yield ChoiceDelta(index, out, chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                                      _usage(usage, len(prompt_ids), completion) if chunk.finish_reason else None)
                if not retry:
                    return
        except client.StreamError as e:
            finished = True
            raise APIError(e.status, str(e)) from None
        finally:
            if not finished and worker is not None:
                self._cancel_later(model, worker.worker_id, request_id)

    def _cancel_later(self, model: str, worker_id: str, request_id: str) -> None:
        # Runs even when the calling task is being cancelled (client disconnect).
        task = asyncio.get_running_loop().create_task(client.cancel(self.bus, model, worker_id, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _usage(last: Usage | None, prompt_tokens: int, completion: int) -> Usage:
    cached = last.cached_tokens if last else 0
    return Usage(prompt_tokens, completion, cached)
