"""Talk to a decode worker over the bus: send a ``GenerateRequest``, iterate its ``TokenChunk``s.

The gateway uses this; so can any Python program that wants the mesh without HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats.errors

from mesh.bus import Bus
from mesh.protocol import Cancel, DecodeError, GenerateRequest, TokenChunk, decode


class StreamError(RuntimeError):
    """The worker went silent or the stream broke; ``status`` is HTTP-like."""

    def __init__(self, message: str, status: int = 504):
        super().__init__(message)
        self.status = status


async def generate(
    bus: Bus, worker_id: str, req: GenerateRequest, first_timeout: float = 120.0, idle_timeout: float = 60.0,
    reply: str | None = None,
) -> AsyncIterator[TokenChunk]:
    """Chunks in order until the one with a finish reason. Raises StreamError on silence or a gap.
    ``reply``: the reply subject (default: a new inbox); a ``cancel`` of the request must name it."""
    inbox = reply or bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, pending_msgs_limit=1 << 16)
    try:
        await bus.publish(bus.subjects.generate(req.model, worker_id), req, reply=inbox)
        expect = 0
        timeout = first_timeout
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                raise StreamError(f"worker {worker_id} sent nothing for {timeout:.0f}s") from None
            try:
                chunk = decode(msg.data, TokenChunk)
            except DecodeError as e:
                raise StreamError(f"worker {worker_id} sent a malformed chunk: {e}", 502) from None
            if chunk.index != expect:
                raise StreamError(f"stream from {worker_id} skipped chunk {expect}", 502)
            expect += 1
            timeout = idle_timeout
            yield chunk
            if chunk.finish_reason is not None:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def cancel(bus: Bus, model: str, worker_id: str, request_id: str, reply: str) -> None:
    """``reply``: the subject the request was sent with (the worker refuses a Cancel naming another)."""
    await bus.publish(bus.subjects.cancel(model, worker_id), Cancel(request_id, reply))
