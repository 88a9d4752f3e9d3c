"""The two request lifecycles as tables: the decode worker's ``ReqState`` and the gateway's
``ChoiceState``. Every transition, every refusal of an event a state does not take, and that
every path ends in a final state."""

from __future__ import annotations

import itertools

import pytest

from decode.lifecycle import TRANSITIONS, Event, IllegalTransition, ReqState, advance
from gateway.choices.choice import ChoiceRun, ChoiceState, RetryPolicy
from gateway.choices.replies import NoResponders, WorkerGone
from mesh.client import StreamError

S, E = ReqState, Event

# -- the decode worker ---------------------------------------------------------------------------

EXPECTED = {
    (S.ADMITTING, E.LOCAL): S.PREFILLING,
    (S.ADMITTING, E.REMOTE): S.WAITING_FOR_KV,
    (S.ADMITTING, E.CANCEL): S.CANCELLED,
    (S.ADMITTING, E.ABORT): S.FAILED,
    (S.ADMITTING, E.REFUSE): S.FAILED,
    (S.WAITING_FOR_KV, E.KV_READY): S.PREFILLING,
    (S.WAITING_FOR_KV, E.FALLBACK): S.PREFILLING,
    (S.WAITING_FOR_KV, E.CANCEL): S.CANCELLING,
    (S.WAITING_FOR_KV, E.ABORT): S.FAILED,
    (S.PREFILLING, E.FIRST_TOKEN): S.DECODING,
    (S.PREFILLING, E.FINISH): S.FINISHED,
    (S.PREFILLING, E.ERROR): S.FAILED,
    (S.PREFILLING, E.CANCEL): S.CANCELLED,
    (S.PREFILLING, E.ABORT): S.FAILED,
    (S.DECODING, E.FINISH): S.FINISHED,
    (S.DECODING, E.ERROR): S.FAILED,
    (S.DECODING, E.CANCEL): S.CANCELLED,
    (S.DECODING, E.ABORT): S.FAILED,
    (S.CANCELLING, E.CANCEL): S.CANCELLING,
    (S.CANCELLING, E.RELEASED): S.CANCELLED,
    (S.CANCELLING, E.ABORT): S.FAILED,
}


@pytest.mark.parametrize(("state", "event"), sorted(itertools.product(S, E)))
def test_every_decode_transition(state, event):
    want = EXPECTED.get((state, event))
    if want is None:
        with pytest.raises(IllegalTransition):
            advance(state, event)
    else:
        assert advance(state, event) is want


def test_the_table_is_exactly_the_documented_one():
    assert TRANSITIONS == EXPECTED


def test_final_states_take_no_event():
    for state in S:
        takes = {e for (s, e) in TRANSITIONS if s is state}
        assert state.is_final == (not takes), state


@pytest.mark.parametrize("path", [
    [E.LOCAL, E.FIRST_TOKEN, E.FINISH],
    [E.LOCAL, E.FINISH],  # max_tokens 1
    [E.LOCAL, E.FIRST_TOKEN, E.ERROR],
    [E.REMOTE, E.KV_READY, E.FIRST_TOKEN, E.FINISH],
    [E.REMOTE, E.FALLBACK, E.FIRST_TOKEN, E.FINISH],
    [E.REMOTE, E.CANCEL, E.CANCEL, E.RELEASED],
    [E.REMOTE, E.KV_READY, E.CANCEL],
    [E.CANCEL],
    [E.REFUSE],
    [E.LOCAL, E.FIRST_TOKEN, E.CANCEL],
    [E.REMOTE, E.ABORT],
    [E.LOCAL, E.FIRST_TOKEN, E.ABORT],
])
def test_every_path_ends_final(path):
    state = S.ADMITTING
    for event in path:
        assert not state.is_final
        state = advance(state, event)
    assert state.is_final


def test_from_every_live_state_abort_ends_it():
    for state in S:
        if not state.is_final:
            assert advance(state, E.ABORT) is S.FAILED


# -- the gateway's choice ------------------------------------------------------------------------

POLICY = RetryPolicy(retries=2, max_migrations=2, unreachable_wait=5.0, first_token_timeout=120.0,
                     idle_timeout=60.0)


def sent_run(**kw) -> ChoiceRun:
    run = ChoiceRun(POLICY, **kw)
    run.sent("w1")
    return run


def test_a_choice_streams_then_finishes():
    run = ChoiceRun(POLICY)
    assert run.state is ChoiceState.ROUTING
    run.sent("w1")
    assert run.state is ChoiceState.WAITING and run.timeout == 120.0 and run.tried == {"w1"}
    run.streamed([1, 2], finished=False)
    assert run.state is ChoiceState.STREAMING and run.timeout == 60.0
    run.streamed([3], finished=True)
    assert run.state is ChoiceState.FINISHED and run.generated == [1, 2, 3]
    run.closed()
    assert run.state is ChoiceState.FINISHED  # closing a finished choice changes nothing


@pytest.mark.parametrize("status", [503, 429])
def test_a_refusal_reroutes_while_retries_and_workers_last(status):
    run = sent_run()
    assert run.refused(status, "busy", untried=True) is ChoiceState.ROUTING
    run.sent("w2")
    assert run.refused(status, "busy", untried=True) is ChoiceState.ROUTING
    run.sent("w3")
    assert run.refused(status, "busy", untried=True) is ChoiceState.FAILED  # retries spent
    assert run.error.status == status


def test_a_refusal_with_no_worker_left_fails_and_429_keeps_its_status():
    run = sent_run()
    assert run.refused(429, "busy", untried=False) is ChoiceState.FAILED
    assert run.error.status == 429 and run.error.headers == {"Retry-After": "1"}
    run = sent_run()
    assert run.refused(503, "draining", untried=False) is ChoiceState.FAILED and run.error.status == 503


@pytest.mark.parametrize(("status", "want"), [(400, 400), (500, 502), (404, 404)])
def test_an_error_chunk_that_is_not_a_refusal_fails_at_once(status, want):
    run = sent_run()
    assert run.refused(status, "no", untried=True) is ChoiceState.FAILED
    assert run.error.status == want


def test_a_lost_worker_migrates_with_the_tokens_already_streamed():
    run = sent_run()
    run.streamed([5, 6], finished=False)
    assert run.lost(WorkerGone("w1"), untried=True) is ChoiceState.ROUTING
    assert run.migrations == 1 and run.generated == [5, 6]
    run.sent("w2")
    assert run.state is ChoiceState.WAITING and run.timeout == 120.0
    assert run.lost(StreamError("silent", 504), untried=True) is ChoiceState.ROUTING
    run.sent("w3")
    assert run.lost(StreamError("silent", 504), untried=True) is ChoiceState.FAILED  # migrations spent
    assert run.error.status == 504


def test_a_broken_stream_that_is_not_a_loss_fails():
    run = sent_run()
    assert run.lost(StreamError("skipped chunk 1", 502), untried=True) is ChoiceState.FAILED
    assert run.error.status == 502


def test_nobody_listening_anywhere_backs_off_then_tries_everyone_again():
    run = sent_run()
    t0 = run.started
    assert run.lost(NoResponders("w1"), untried=False, now=t0 + 1.0) is ChoiceState.BACKOFF
    run.backed_off()
    assert run.state is ChoiceState.ROUTING and run.tried == set()
    run.sent("w1")
    assert run.lost(NoResponders("w1"), untried=False, now=t0 + 6.0) is ChoiceState.FAILED  # waited enough
    assert run.error.status == 503


def test_no_worker_to_route_to_fails():
    from gateway.errors import APIError

    run = ChoiceRun(POLICY)
    run.no_worker(APIError(503, "no live worker"))
    assert run.state is ChoiceState.FAILED and run.error.status == 503


@pytest.mark.parametrize("state", [ChoiceState.ROUTING, ChoiceState.WAITING, ChoiceState.STREAMING,
                                   ChoiceState.BACKOFF])
def test_closing_a_live_choice_ends_it(state):
    run = ChoiceRun(POLICY, state=state)
    run.closed()
    assert run.state is ChoiceState.CLOSED and run.state.is_final


def test_events_a_state_does_not_take_are_refused():
    run = ChoiceRun(POLICY)
    with pytest.raises(RuntimeError):
        run.streamed([1], finished=False)  # nothing was sent
    run.sent("w1")
    with pytest.raises(RuntimeError):
        run.sent("w2")
    with pytest.raises(RuntimeError):
        run.backed_off()
    run.streamed([1], finished=True)
    for event in (lambda: run.lost(WorkerGone("w1"), True), lambda: run.refused(503, "x", True)):
        with pytest.raises(RuntimeError):
            event()
