"""The embed worker (``mesh worker decode --task embed``): pooled hidden states on request.

The model's forward without the KV cache's decode path: no KV pool, no scheduler, no prefill
jobs, no KV events (``engine.pooling.Embedder``). Its card has role ``embed`` (and its vector
size, ``embed_dim``), so routers and gateways keep it out of the generate pool; the gateway's
``/v1/embeddings`` sends it ``EmbedRequest``s on its ``embed`` subject and takes its
``EmbedReply``s.

    embed subject --> check (400s, on the loop) --> EmbedBatcher queue
                          one forward at a time, in the worker's one torch thread:
                          every request queued meanwhile joins the next forward (token budget,
                          highest priority first: batch lines wait for interactive requests)
                      --> vectors, truncated per request (matryoshka) --> EmbedReply

Who ends what: a request's future is the batcher's to resolve (result, or the forward's error);
a request whose handler is gone (worker stopping) is dropped with its future. Nothing is held
between requests but the model's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch

from engine.pooling import Embedder, PoolingConfig, truncate
from mesh import metrics
from mesh.errors import RequestError
from mesh.procutil import cancel_and_wait
from mesh.protocol import EmbedReply, EmbedRequest, LoadReport, WorkerCard
from worker.core import WorkerCore
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    inputs: list[list[int]]
    dimensions: int
    done: asyncio.Future
    priority: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.inputs)


class EmbedBatcher:
    """One forward at a time, in a thread of its own (the event loop never waits for torch);
    requests queued while it runs go into the next forward together, up to ``max_tokens``
    prompt tokens (at least one request)."""

    def __init__(self, embedder: Embedder, max_tokens: int):
        self.embedder = embedder
        self.max_tokens = max_tokens
        self.queue: list[_Pending] = []
        self.running = 0  # requests in the forward now
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="embed")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="embed-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        for p in self.queue:
            if not p.done.done():
                p.done.set_exception(RequestError("the worker stopped"))
        self.queue.clear()
        # a forward still running finishes in its thread: wait for it off the loop
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    async def embed(self, inputs: list[list[int]], dimensions: int = 0, priority: int = 0) -> torch.Tensor:
        """``[len(inputs), dim]`` float32, normalised (``dimensions`` already checked)."""
        p = _Pending(inputs, dimensions, asyncio.get_running_loop().create_future(), priority)
        self.queue.append(p)
        self._wake.set()
        return await p.done

    def _take(self) -> list[_Pending]:
        """The next forward's requests: highest priority first, first come first within one."""
        self.queue.sort(key=lambda p: -p.priority)  # stable
        batch, tokens = [], 0
        while self.queue and (not batch or tokens + self.queue[0].tokens <= self.max_tokens):
            p = self.queue.pop(0)
            if not p.done.done():  # its handler is gone: nobody wants it
                batch.append(p)
                tokens += p.tokens
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                batch = self._take()
                if not batch:
                    continue
                self.running = len(batch)
                inputs = [prompt for p in batch for prompt in p.inputs]
                try:
                    vectors = await loop.run_in_executor(self._executor, self.embedder.embed, inputs)
                except Exception as e:  # the forward failed: every request of it gets the error
                    log.exception("an embedding forward failed")
                    for p in batch:
                        if not p.done.done():
                            p.done.set_exception(e)
                    continue
                finally:
                    self.running = 0
                start = 0
                for p in batch:
                    part = vectors[start:start + len(p.inputs)]
                    start += len(p.inputs)
                    if not p.done.done():
                        p.done.set_result(truncate(part, p.dimensions))


class EmbedWorker(WorkerCore):
    """A worker of role ``embed``: the registry card, the ``embed`` subject, load reports, drain
    (``WorkerCore``'s lifecycle, with the embedder for an engine)."""

    role = "embed"

    def __init__(self, settings: WorkerSettings):
        super().__init__(settings)
        self.embedder: Embedder | None = None
        self.batcher: EmbedBatcher | None = None
        self.inflight = 0
        self._requests: set[asyncio.Task] = set()

    def build(self) -> Embedder:
        config = self.settings.engine
        return Embedder(config, PoolingConfig.from_dir(config.model, self.settings.pooling))

    # -- WorkerCore's hooks -----------------------------------------------------------
    def open_engine(self) -> None:
        self.embedder = self.build()

    def warm_up(self) -> None:
        self.embedder.warm_up()

    def served_model(self) -> str:
        return self.embedder.model_name

    def serving_note(self) -> str:
        return f" ({self.embedder.pooling.method} pooling)"

    async def start(self, stack: AsyncExitStack, stop: asyncio.Event) -> None:
        self.batcher = EmbedBatcher(self.embedder, self.embedder.budget)
        self.batcher.start()
        stack.push_async_callback(self.batcher.stop)
        subject = self.bus.subjects.embed(self.embedder.model_name, self.worker_id)
        sub = await self.bus.subscribe(subject, self._on_request_soon, EmbedRequest)
        stack.push_async_callback(_unsubscribe, sub)

    def card(self) -> WorkerCard:
        e = self.embedder
        return WorkerCard(
            worker_id=self.worker_id, role=self.role, model=e.model_name, block_size=0, kv_blocks=0,
            max_model_len=e.max_model_len, host=socket.gethostname(), pid=os.getpid(), started=self.started,
            updated=time.time(), status=self.status, capacity=1, metrics_port=self.metrics_port,
            publishes_kv_events=False, embed_dim=e.hidden_size,
        )

    # -- requests -----------------------------------------------------------------
    async def _on_request_soon(self, req: EmbedRequest, raw) -> None:
        """A subscription runs its handler one message at a time: each request in a task of its
        own, so that requests arriving during a forward queue for the next one together."""
        task = asyncio.get_running_loop().create_task(self.on_request(req, raw))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def on_request(self, req: EmbedRequest, raw) -> None:
        self.counters.requests += 1
        self.inflight += 1
        try:
            reply = await self._serve(req)
        finally:
            self.inflight -= 1
        outcome = "finished" if not reply.error else "error"
        metrics.WORKER_REQUESTS.labels(self.embedder.model_name, self.role, outcome).inc()
        with contextlib.suppress(Exception):  # the requester gave up: nobody to tell
            await self.bus.respond(raw, reply)

    async def _serve(self, req: EmbedRequest) -> EmbedReply:
        if self.status != "ready":
            return self._error(req, "the worker is draining", 503)
        if req.model != self.embedder.model_name:
            return self._error(req, f"this worker serves {self.embedder.model_name!r}, not {req.model!r}", 404)
        try:
            self.embedder.check(req.inputs, req.dimensions)
            vectors = await self.batcher.embed(req.inputs, req.dimensions, req.priority)
        except RequestError as e:
            self.counters.errors += 1
            return self._error(req, str(e), 400)
        except Exception as e:
            self.counters.errors += 1
            return self._error(req, f"the embedding forward failed: {e}", 500)
        self.counters.finished += 1
        dim = vectors.shape[1]
        return EmbedReply(req.request_id, self.worker_id, dim, vectors.numpy().astype("<f4").tobytes())

    def _error(self, req: EmbedRequest, message: str, status: int) -> EmbedReply:
        return EmbedReply(req.request_id, self.worker_id, error=message, error_status=status)

    # -- load and drain -------------------------------------------------------------
    async def next_load(self) -> LoadReport:
        c = self.counters
        return LoadReport(
            worker_id=self.worker_id, model=self.embedder.model_name, role=self.role, timestamp=time.time(),
            waiting=len(self.batcher.queue), running=self.batcher.running, capacity=1,
            requests_total=c.requests, status=self.status,
            counters={"requests": c.requests, "finished": c.finished, "errors": c.errors},
        )

    def in_flight(self) -> int:
        return self.inflight

    async def drain(self, stop: asyncio.Event | None = None) -> None:
        """Take no new requests (503: the gateway sends them elsewhere), let those in flight
        finish (bounded as a decode worker's drain), then drop the handlers left and return to
        deregister."""
        await super().drain(stop)
        if self._requests:
            await cancel_and_wait(list(self._requests))


async def _unsubscribe(sub) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
