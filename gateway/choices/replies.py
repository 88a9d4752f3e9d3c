"""Token streams from decode workers, all on one reply subscription per gateway.

Each request gets a reply subject under the gateway's inbox prefix and asks its worker to batch
(``GenerateRequest.batch_to`` = ``{prefix}.batch``): a worker then sends one ``TokenBatch`` per
engine step with the chunks of all our requests it serves, each tagged with its stream's key,
and this module hands each chunk to its ``ReplyStream``. A worker that does not batch (a custom
one) publishes each ``TokenChunk`` on the request's own reply subject, which the same wildcard
subscription receives. A chunk is taken only from the worker its stream was sent to (the
batch's or chunk's ``worker``); any other is logged, counted and dropped. A reader takes *all* the chunks that have arrived (``next_batch``), so
under load a request's tokens are detokenized and written to the client together rather than
one event each, and no per-request subscription is made or torn down on the server.

This is ``mesh.client.generate`` (same checks: in order, no gaps, timeouts as
``StreamError``) without a subscription and a ``wait_for`` task per request
and per chunk, which is most of what the gateway costs per token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable

from gateway import metrics
from gateway.limits import reply_buffer_limits
from mesh.bus import Bus
from mesh.client import StreamError
from mesh.metrics import BUS_DROPPED, REFUSED_MESSAGES
from mesh.protocol import DecodeError, TokenBatch, TokenChunk, decode

log = logging.getLogger(__name__)
BATCH_TOKEN = "batch"  # the subject token of TokenBatches (stream keys are hex, so never this)

_TIMED_OUT = object()
_GONE = object()  # pushed when the stream's worker left the registry
_NO_RESPONDERS = object()  # NATS answered the request itself: nobody subscribes to the worker's subject


class WorkerGone(StreamError):
    """The worker serving the stream left the registry (killed, or its card expired)."""

    def __init__(self, worker_id: str):
        super().__init__(f"worker {worker_id} went away mid-request", 503)


class NoResponders(StreamError):
    """NATS itself answered the request: nobody subscribes to the worker's subject (it died, or
    it is re-subscribing after the server restarted)."""

    def __init__(self, worker_id: str):
        super().__init__(f"worker {worker_id} is not listening", 503)


class ReplyStreams:
    """The gateway's reply subscription and the streams waiting on it."""

    def __init__(self, bus: Bus, max_inflight: int = 1024):
        self.bus = bus
        self.max_inflight = max_inflight  # bounds the subscription's buffer (gateway.limits)
        self.prefix = bus.nc.new_inbox()
        self.batch_subject = f"{self.prefix}.{BATCH_TOKEN}"
        self._streams: dict[str, ReplyStream] = {}
        self._keys = itertools.count()
        self._sub = None
        self.stray = 0  # chunks for requests already closed (a cancelled request's tail)
        self.dropped = 0  # undecodable batches (their streams time out; single chunks fail their stream)

    async def start(self) -> None:
        msgs, nbytes = reply_buffer_limits(self.max_inflight)
        self._sub = await self.bus.nc.subscribe(
            self.prefix + ".*", cb=self._on_msg, pending_msgs_limit=msgs, pending_bytes_limit=nbytes
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    def worker_gone(self, worker_id: str) -> int:
        """Wake every stream served by ``worker_id`` with ``WorkerGone``; returns how many."""
        gone = [s for s in self._streams.values() if s.worker_id == worker_id]
        for s in gone:
            s.push(_GONE)
        return len(gone)

    def open(self, worker_id: str) -> ReplyStream:
        key = format(next(self._keys), "x")
        stream = ReplyStream(self, key, worker_id)
        self._streams[key] = stream
        return stream

    async def _on_msg(self, msg) -> None:
        key = msg.subject[len(self.prefix) + 1 :]
        if key == BATCH_TOKEN:
            self._on_batch(msg.data)
            return
        stream = self._streams.get(key)
        if stream is None:
            self.stray += 1
            return
        if not msg.data:  # no chunk is ever empty: this is the server's 503 "no responders" status
            stream.push(_NO_RESPONDERS)
            return
        try:
            chunk = decode(msg.data, TokenChunk)
        except DecodeError as e:
            BUS_DROPPED.labels("TokenChunk", e.reason).inc()
            stream.push(StreamError(f"worker {stream.worker_id} sent a malformed chunk: {e}", 502))
            return
        if chunk.worker != stream.worker_id:
            _refuse(chunk.worker, stream)
            return
        stream.push(chunk)

    def on_link_batch(self, data: bytes, workers: set[str]) -> None:
        """A TokenBatch from a token link on which ``workers`` proved who they are (``mesh.tokenlink``)."""
        metrics.LINK_BATCHES.inc()
        self._on_batch(data, workers)

    def _on_batch(self, data: bytes, bound: set[str] | None = None) -> None:
        try:
            batch = decode(data, TokenBatch)
        except DecodeError as e:
            self.dropped += 1
            BUS_DROPPED.labels("TokenBatch", e.reason).inc()
            log.warning("dropped a malformed token batch: %s", e)
            return
        if bound is not None and batch.worker not in bound:  # a link speaks for the workers proven on it
            log.warning("refused a token batch naming %r on a link of %d other workers", batch.worker, len(bound))
            REFUSED_MESSAGES.labels("gateway", "link_other_worker").inc()
            return
        metrics.TOKEN_BATCHES.inc()
        metrics.BATCHED_CHUNKS.inc(len(batch.chunks))
        streams = self._streams
        for chunk in batch.chunks:
            stream = streams.get(chunk.stream)
            if stream is None:
                self.stray += 1
            elif stream.worker_id != batch.worker:
                _refuse(batch.worker, stream)
            else:
                stream.push(chunk)


class ReplyStream:
    """One request's chunks, in order, from one worker."""

    __slots__ = ("_armed_for", "_deadline", "_loop", "_pending", "_timeout", "_timer", "_waiter", "expect", "key", "owner",
                 "sink", "subject", "worker_id")

    def __init__(self, owner: ReplyStreams, key: str, worker_id: str):
        self.owner = owner
        self.key = key
        self.subject = f"{owner.prefix}.{key}"
        self.worker_id = worker_id
        self.expect = 0
        self._pending: deque[TokenChunk | StreamError | object] = deque()
        self._waiter: asyncio.Future | None = None
        # One timer per stream, re-armed only when it fires early or a shorter wait begins: a
        # call_later and a cancel per wait (per token, at GPU pace) cost ~1.6 us (docs/benchmarks.md, "What the probes found").
        self._deadline = 0.0  # when the current wait times out (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = 0.0  # when the timer fires
        # asyncio.get_running_loop() makes a getpid() syscall per call on CPython 3.11 (1.7% of the
        # gateway's samples at C=128, real pace, when next_batch called it per token)
        self._loop = asyncio.get_running_loop()
        self._timeout = 0.0  # of the current wait
        # choices.direct.DirectSink: takes the next chunk in order, while the reader waits with
        # nothing queued, and returns True when it has handled it (the reader never sees it)
        self.sink: Callable[[TokenChunk], bool] | None = None

    def push(self, data: TokenChunk | StreamError | object) -> None:
        sink, w = self.sink, self._waiter
        if (sink is not None and w is not None and type(data) is TokenChunk and not self._pending
                and data.index == self.expect and not w.done()):
            try:
                taken = sink(data)
            except Exception as e:  # it reaches the reader, as the same error would
                taken, data = False, e
            if taken:
                self.expect += 1
                self._deadline = self._loop.time() + self._timeout  # the wait starts over
                return
        self._pending.append(data)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_batch(self, timeout: float) -> list[TokenChunk]:
        """Every chunk that has arrived (waiting up to ``timeout`` for the first); stops at the last one."""
        if not self._pending:
            loop = self._loop
            self._waiter = waiter = loop.create_future()
            self._timeout = timeout
            self._deadline = deadline = loop.time() + timeout
            if self._timer is None or deadline < self._armed_for:
                self._arm(loop, deadline)
            try:
                if await waiter is _TIMED_OUT:
                    raise StreamError(f"worker {self.worker_id} sent nothing for {timeout:g}s")
            finally:
                self._waiter = None
        out = []
        pending = self._pending
        while pending:
            chunk = pending.popleft()
            if type(chunk) is not TokenChunk:  # the stream broke: after what did arrive, say how
                if out:
                    pending.appendleft(chunk)
                    break
                if chunk is _NO_RESPONDERS:
                    raise NoResponders(self.worker_id)
                if chunk is _GONE:
                    raise WorkerGone(self.worker_id)
                raise chunk  # a StreamError, or what the sink raised
            if chunk.index != self.expect:
                raise StreamError(f"stream from {self.worker_id} skipped chunk {self.expect}", 502)
            self.expect += 1
            out.append(chunk)
            if chunk.finish_reason is not None or chunk.error:
                self._pending.clear()
                break
        return out

    def close(self) -> None:
        self.owner._streams.pop(self.key, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = when
        self._timer = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """The timer fired: time the wait out if it is past its deadline, else wait on for it."""
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # nobody waits: the next wait arms a timer again
        loop = self._loop
        if loop.time() < self._deadline:  # this wait began after the timer was armed
            self._arm(loop, self._deadline)
        else:
            w.set_result(_TIMED_OUT)


def _refuse(sender: str, stream: ReplyStream) -> None:
    """A chunk for a stream from a worker other than the one serving it: logged, counted, dropped."""
    log.warning("refused a token chunk from %r for a stream served by %s", sender, stream.worker_id)
    REFUSED_MESSAGES.labels("gateway", "unbound_chunk").inc()

