"""A decode worker's request, from ``GenerateRequest`` to its last chunk: one state, one table.

    ADMITTING --LOCAL--> PREFILLING --FIRST_TOKEN--> DECODING --FINISH--> FINISHED
        |                   ^   ^                               --ERROR---> FAILED
        |                   |   +--KV_READY--+
        +--REMOTE--> WAITING_FOR_KV          |
                            +---FALLBACK-----+   (the job failed, was late or could not be queued)

    CANCEL: from ADMITTING, PREFILLING, DECODING straight to CANCELLED; from WAITING_FOR_KV to
    CANCELLING, which RELEASED (the prefill worker's PrefillDone or its deadline) ends in CANCELLED.
    ABORT (the engine died, the worker stops): any live state to FAILED.

``WAITING_FOR_KV``: a prefill worker may be writing the request's blocks, so nothing frees them
until its ``PrefillDone`` arrives or its deadline passes. A request can finish with its first
chunk (max_tokens 1, a stop token first): PREFILLING --FINISH--> FINISHED.

``advance`` is the only place a state changes; the worker acts on what it returns. The table
is data, so every transition is unit-tested without a worker.
"""

from __future__ import annotations

from enum import IntEnum


class ReqState(IntEnum):
    ADMITTING = 0  # arrived; the engine is deciding local or remote prefill
    WAITING_FOR_KV = 1  # a prefill worker owns the reserved blocks
    PREFILLING = 2  # the engine has it (queued, prefilling, or its remote KV just landed)
    DECODING = 3  # the first chunk is out
    CANCELLING = 4  # cancelled while a prefill worker owns the blocks: waits for them
    FINISHED = 10
    CANCELLED = 11
    FAILED = 12

    @property
    def is_final(self) -> bool:
        return self >= ReqState.FINISHED


class Event(IntEnum):
    LOCAL = 0  # admitted for a local prefill
    REMOTE = 1  # blocks reserved and a prefill job published
    KV_READY = 2  # the prefill worker wrote the blocks; the engine emits the first token next
    FALLBACK = 3  # the remote prefill failed, timed out or could not be queued: prefill here
    FIRST_TOKEN = 4  # the first chunk went out
    FINISH = 5  # the last chunk went out (stop or length)
    ERROR = 6  # the engine failed this request (its last chunk is an error)
    CANCEL = 7  # the client went away (a Cancel from the gateway)
    RELEASED = 8  # a cancelled request's prefill worker let go of its blocks (done, failed or late)
    ABORT = 9  # the engine died or the worker stops with the request unfinished


S, E = ReqState, Event
TRANSITIONS: dict[tuple[ReqState, Event], ReqState] = {
    (S.ADMITTING, E.LOCAL): S.PREFILLING,
    (S.ADMITTING, E.REMOTE): S.WAITING_FOR_KV,
    (S.WAITING_FOR_KV, E.KV_READY): S.PREFILLING,
    (S.WAITING_FOR_KV, E.FALLBACK): S.PREFILLING,
    (S.PREFILLING, E.FIRST_TOKEN): S.DECODING,
    (S.PREFILLING, E.FINISH): S.FINISHED,
    (S.DECODING, E.FINISH): S.FINISHED,
    (S.PREFILLING, E.ERROR): S.FAILED,
    (S.DECODING, E.ERROR): S.FAILED,
    (S.ADMITTING, E.CANCEL): S.CANCELLED,  # the engine's abort is queued after the admission
    (S.PREFILLING, E.CANCEL): S.CANCELLED,
    (S.DECODING, E.CANCEL): S.CANCELLED,
    (S.WAITING_FOR_KV, E.CANCEL): S.CANCELLING,
    (S.CANCELLING, E.CANCEL): S.CANCELLING,  # a second cancel changes nothing
    (S.CANCELLING, E.RELEASED): S.CANCELLED,
}
for _s in (S.ADMITTING, S.WAITING_FOR_KV, S.PREFILLING, S.DECODING, S.CANCELLING):
    TRANSITIONS[(_s, E.ABORT)] = S.FAILED


class IllegalTransition(RuntimeError):
    pass


def advance(state: ReqState, event: Event) -> ReqState:
    """The state after ``event``; ``IllegalTransition`` for an event the state does not take."""
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        raise IllegalTransition(f"{event.name} in state {state.name}")
    return nxt
