"""Getting choices to the client: whole responses, SSE, and noticing that the client has gone.

Each choice is a ``Gateway.stream_choice`` async generator. Closing or cancelling one that has
not finished cancels its request on the worker (its ``finally``), so every path here ends by
closing them all: a finished response, an error, a client that disconnects while we wait for
tokens (non-streaming: ``unless_disconnected``) or while we stream them (``SSEResponse``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring_ascii as _js
from typing import TYPE_CHECKING

from fastapi.responses import Response

from gateway.errors import APIError
from gateway.service import ChoiceDelta

if TYPE_CHECKING:
    from gateway.formats import TextFrame


async def _collect(stream: AsyncIterator[ChoiceDelta]) -> list[ChoiceDelta]:
    return [d async for d in stream]


async def collect_all(streams) -> list[list[ChoiceDelta]]:
    if len(streams) == 1:
        return [await _collect(streams[0])]
    tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed or we were cancelled: stop the others (each cancels on its worker)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_deltas(streams) -> list[ChoiceDelta | None]:
    if len(streams) == 1:
        return [await anext(streams[0], None)]
    tasks = [asyncio.ensure_future(anext(s, None)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _first_of(a: asyncio.Future, b: asyncio.Future) -> None:
    """Returns when either is done. asyncio.wait would do: it costs an ABC isinstance check per
    awaitable per call (a few % of the gateway's CPU, once per request), where two done-callbacks
    on one future cost nothing."""
    either = asyncio.get_running_loop().create_future()

    def done(_: asyncio.Future) -> None:
        if not either.done():
            either.set_result(None)

    a.add_done_callback(done)
    b.add_done_callback(done)
    await either


async def unless_disconnected(receive, work: Awaitable):
    """``await work``, unless the client disconnects first: then cancel it and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await _first_of(task, watch)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def close_all(streams) -> None:
    """Close choice streams (an unfinished one cancels its request on the worker)."""
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def sse_events(fmt, streams, first: list[ChoiceDelta | None], include_usage: bool, has_tok: bool,
                     release: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE text of a response (``fmt``: a ``gateway.formats.Format``); ``release`` runs at the end.
    One choice's deltas are read here directly, not through ``_one_stream``: an async generator
    less to pass through per token."""
    events = None if len(streams) == 1 else _merged_streams(streams, first)
    try:
        if opening := fmt.opening(len(streams)):
            yield opening
        if events is None:
            d, stream = first[0], streams[0]
            while d is not None:
                if out := fmt.chunks(d, has_tok):
                    yield out
                if d.finish_reason is not None:
                    break
                try:
                    d = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except APIError as e:
                    yield fmt.error_event(e)
                    break
        else:
            async for d in events:
                if isinstance(d, APIError):
                    yield fmt.error_event(d)
                    continue
                if out := fmt.chunks(d, has_tok):
                    yield out
        async for tail in fmt.closing(include_usage):
            yield tail
    finally:
        if events is not None:
            with contextlib.suppress(Exception):
                await events.aclose()
        await close_all(streams)
        release()


async def _one_stream(stream, head: ChoiceDelta | None):
    if head is None:
        return
    yield head
    if head.finish_reason is not None:
        return
    try:
        async for d in stream:
            yield d
    except APIError as e:
        yield e


async def _merged_streams(streams, first: list[ChoiceDelta | None]):
    """n > 1: every choice's deltas as they come (a choice's error ends only that choice)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream, head):
        try:
            async for d in _one_stream(stream, head):
                queue.put_nowait(d)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(s, h)) for s, h in zip(streams, first, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(Response):
    """A text/event-stream body that stops (and closes its generator) the moment the client goes.

    Starlette's StreamingResponse only notices a disconnect through the ASGI receive channel
    with an anyio task group per response; this does the same with two asyncio tasks, and
    always ``aclose``s the generator, which is what cancels the request on the worker.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str], direct: SSEWriter | None = None):
        # not Response.__init__: it would add "content-length: 0"
        self.status_code = 200
        self.background = None
        self.events = events
        self.direct = direct  # the choice's DirectSink writes through it while the body is sent
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            *((k.lower().encode(), v.encode()) for k, v in headers.items())]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.direct is not None:
            self.direct.attach(send)
        body = asyncio.ensure_future(self._send_events(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await _first_of(body, watch)
        finally:
            if self.direct is not None:
                self.direct.detach()
            for t in (body, watch):
                t.cancel()
            await asyncio.gather(body, watch, return_exceptions=True)
            await self.events.aclose()

    async def _send_events(self, send) -> None:
        try:
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            pass


class SSEWriter:
    """One choice's deltas as SSE events, written straight to the client's socket by its
    ``DirectSink`` (gateway/choices/direct.py) rather than through the response's ASGI ``send``.

    Only behind uvicorn's httptools protocol, whose ``send`` is a method of the connection's
    request-response cycle: ``attach`` takes the cycle's transport, and ``write`` frames each event
    as that ``send`` does (a chunk of the chunked body). Behind any other server ``ready`` stays
    False, and every event goes through ``send``. ``ready`` is False wherever ``send`` would wait
    or drop the write: a paused transport (the client reads slower than we write), a disconnect,
    an ended body, a closing transport.
    """

    __slots__ = ("cycle", "fmt", "frame", "has_tok")

    def __init__(self, fmt, has_tok: bool):
        self.fmt = fmt
        self.has_tok = has_tok
        self.cycle = None
        self.frame: TextFrame | None = None

    def attach(self, send) -> None:
        """After the response's start: write through ``send``'s connection if it is uvicorn's."""
        cycle = getattr(send, "__self__", None)
        if type(cycle).__module__ == _UVICORN_HTTPTOOLS and getattr(cycle, "chunked_encoding", None) is True:
            self.cycle = cycle

    def detach(self) -> None:
        self.cycle = None

    def ready(self) -> bool:
        c = self.cycle
        return c is not None and not (c.flow.write_paused or c.disconnected or c.response_complete
                                      or c.transport.is_closing())

    def write(self, delta: ChoiceDelta) -> None:
        if text := self.fmt.chunks(delta, self.has_tok):
            body = text.encode()
            self.cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def text_frame(self, index: int) -> TextFrame | None:
        """The frame of choice ``index``'s plain text events (``Format.text_frame``), kept once found."""
        frame = self.frame
        if frame is None:
            frame = self.frame = self.fmt.text_frame(index)
        return frame

    def write_text(self, frame: TextFrame, text: str) -> None:
        """The event ``write`` would write for a delta of only ``text`` (not empty): the same bytes,
        built without the ``ChoiceDelta``, the event's str and its encoding (one token's event at GPU
        pace: python -m bench stream-costs)."""
        body = _js(text).encode()
        self.cycle.transport.write(b"%x\r\n%b%b%b\r\n" % (frame.size + len(body), frame.head, body, frame.tail))


_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


async def _wait_disconnect(receive) -> None:
    """Returns when the client has gone (the request body is already read, so this only waits)."""
    while (await receive())["type"] != "http.disconnect":
        pass
