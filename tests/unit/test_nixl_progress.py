"""The nixl progress thread's pace (``kvstore/transfer/nixl_progress.py``): fast after a write grant
for long enough that a short prefill's write lands within it (its writer then sends no kick),
gentle while a long prefill computes, fast again on a kick. Against a stand-in for NIXL's agent
(never polled here: nothing is in flight long enough) and a clock the test moves."""

from __future__ import annotations

import pytest

from kvstore.transfer import nixl_progress
from kvstore.transfer.nixl_progress import (
    FAST_FOR,
    GRANT_FAST_FOR,
    POLL_FAST,
    POLL_SLOW,
    POLL_WAIT,
    Progress,
)


class IdleAgent:
    """NIXL's agent, with nothing ever arriving."""

    def get_new_notifs(self):
        return {}

    def check_xfer_state(self, handle):
        return "PROC"


@pytest.fixture
def now(monkeypatch):
    t = [1000.0]
    monkeypatch.setattr(nixl_progress, "clock", lambda: t[0])
    return t


async def test_a_grant_keeps_the_receiver_fast_for_a_short_prefill_then_a_kick_does(now):
    p = Progress(IdleAgent(), lambda got: None)
    p.expect(b"kv:r:1", GRANT_FAST_FOR)  # granted: the write comes within a short prefill
    assert p.pace() == POLL_FAST
    now[0] += FAST_FOR * 2  # past a transfer's fast window, inside the grant's
    assert FAST_FOR * 2 < GRANT_FAST_FOR and p.pace() == POLL_FAST
    now[0] += GRANT_FAST_FOR  # a long prefill: gentle polls until its writer kicks
    assert p.pace() == POLL_WAIT
    p.kick()
    assert p.pace() == POLL_FAST
    now[0] += FAST_FOR + 11.0  # nothing new for long: its writer is likely gone
    assert p.pace() == POLL_SLOW
    p.unexpect(b"kv:r:1")


async def test_a_notification_awaited_without_a_grant_is_fast_only_briefly(now):
    p = Progress(IdleAgent(), lambda got: None)
    p.expect(b"fetch:f:1")
    assert p.pace() == POLL_FAST
    now[0] += FAST_FOR * 2
    assert p.pace() == POLL_WAIT
    p.unexpect(b"fetch:f:1")
