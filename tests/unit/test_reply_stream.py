"""``ReplyStream.next_batch``'s timeouts with one lazily re-armed timer per stream (issue 33): a
wait still times out at its own deadline, whether it is shorter or longer than the last one."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.replies import ReplyStream
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
