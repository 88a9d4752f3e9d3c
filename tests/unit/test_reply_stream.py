"""``ReplyStream.next_batch``'s timeouts with one lazily re-armed timer per stream (issue 33): a
wait still times out at its own deadline, whether it is shorter or longer than the last one; and
its ``sink``, which takes the mid-stream chunks from the reader (gateway/choices/direct.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.choices.replies import ReplyStream
from mesh.client import StreamError
from mesh.protocol import TokenChunk


class _Owner:
    prefix = "_INBOX.test"

    def __init__(self):
        self._streams = {}


def chunk(i: int) -> TokenChunk:
    return TokenChunk("r", i, [100 + i], worker="w")


def stream() -> ReplyStream:
    return ReplyStream(_Owner(), "1", "w")


async def test_a_silent_stream_times_out_at_its_deadline():
    s = stream()
    t0 = time.monotonic()
    with pytest.raises(StreamError, match=r"sent nothing for 0\.05s"):
        await s.next_batch(0.05)
    assert time.monotonic() - t0 >= 0.04  # not before its deadline


async def test_a_shorter_wait_after_a_long_one_times_out_on_its_own():
    s = stream()
    asyncio.get_running_loop().call_later(0.02, s.push, chunk(0))
    assert [c.index for c in await s.next_batch(30.0)] == [0]  # the first-token wait (long)
    with pytest.raises(StreamError):  # (not the TimeoutError of a wait left to the 30 s timer)
        await asyncio.wait_for(s.next_batch(0.05), 10)  # an idle wait, shorter than the first


async def test_a_wait_that_began_after_the_timer_was_armed_gets_its_full_time():
    s = stream()
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, s.push, chunk(0))
    assert [c.index for c in await s.next_batch(0.15)] == [0]  # arms the timer for t = 0.15
    loop.call_later(0.1, s.push, chunk(1))  # t = 0.2: past the first timer, within this wait's 0.15 s
    assert [c.index for c in await s.next_batch(0.15)] == [1]
    assert s._timer is not None
    s.close()
    assert s._timer is None  # a closed stream leaves no timer behind


class _Sink:
    """Takes chunks while ``take`` says so (gateway.choices.direct.DirectSink's contract)."""

    def __init__(self, take=lambda c: True):
        self.take = take
        self.got: list[int] = []

    def __call__(self, c: TokenChunk) -> bool:
        if not self.take(c):
            return False
        self.got.append(c.index)
        return True


async def test_a_sink_takes_the_chunks_that_arrive_while_the_reader_waits():
    """Issue 33: the mid-stream chunks are handled where they land; the reader sees only the ones
    the sink declines, in order, and a wait still times out counting from the sink's last chunk."""
    s = stream()
    s.sink = sink = _Sink(lambda c: c.index < 3)
    s.push(chunk(0))  # nobody waits yet: queued for the reader, not the sink
    assert [c.index for c in await s.next_batch(5.0)] == [0]
    loop = asyncio.get_running_loop()
    for i in (1, 2, 3):  # every 0.2 s, against a 0.3 s timeout: each chunk the sink takes restarts the wait
        loop.call_later(0.2 * i, s.push, chunk(i))
    assert [c.index for c in await s.next_batch(0.3)] == [3]  # 1 and 2 went to the sink
    assert sink.got == [1, 2] and s.expect == 4
    s.sink = _Sink()
    loop.call_later(0.01, s.push, chunk(5))  # out of order (4 not yet seen): never given to the sink
    with pytest.raises(StreamError, match="skipped chunk 4"):
        await s.next_batch(5.0)
    assert sink.got == [1, 2]


async def test_a_sink_is_never_given_a_chunk_while_others_are_queued():
    s = stream()
    s.sink = sink = _Sink()
    waiting = asyncio.ensure_future(s.next_batch(5.0))
    await asyncio.sleep(0)
    s._waiter.set_result(None)  # the reader was woken and has not run yet
    s.push(chunk(0))
    s.push(chunk(1))
    assert [c.index for c in await waiting] == [0, 1]
    assert sink.got == []


async def test_an_error_in_the_sink_reaches_the_reader():
    s = stream()

    def broken(c: TokenChunk) -> bool:
        raise ValueError("bad token")

    s.sink = broken
    asyncio.get_running_loop().call_later(0.01, s.push, chunk(0))
    with pytest.raises(ValueError, match="bad token"):
        await s.next_batch(5.0)
