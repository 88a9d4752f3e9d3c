"""One choice's life in the gateway: which worker streams it, and what happens when one fails.

    ROUTING --sent--> WAITING --chunks--> STREAMING --last chunk--> FINISHED
       ^                 |                    |
       |  refused (503/429 before any token, an untried worker left, retries left)
       +-----------------+                    |
       |  lost (the worker died or went silent: 503/504; migrations left, an untried worker left)
       +--------------------------------------+
       |
    BACKOFF <--lost: nobody listens anywhere (NATS "no responders") within ``unreachable_wait``
       +--after UNREACHABLE_BACKOFF, every worker is untried again--> ROUTING

    Anything else ends in FAILED (``error`` is what the client gets); the client going away or a
    stop string closing the stream early ends in CLOSED.

``ChoiceRun`` is the choice's one state object: its counters, the tokens already streamed (a
resumed request continues after them), and ``state``, which only its methods move. It does no
I/O, so every transition is unit-tested without a bus; ``Gateway.stream_choice`` does the I/O
each state asks for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from gateway.choices.replies import NoResponders
from gateway.errors import APIError, upstream
from mesh.client import StreamError

UNREACHABLE_BACKOFF = 0.5  # seconds between rounds over workers nobody answers for


class ChoiceState(IntEnum):
    ROUTING = 0  # pick a worker not tried yet and send it the request
    WAITING = 1  # sent; nothing from this worker yet
    STREAMING = 2  # its chunks are arriving
    BACKOFF = 3  # every worker tried is unreachable: wait, then try them all again
    FINISHED = 10  # the worker's last chunk, or a stop string, ended the choice
    FAILED = 11  # ``error`` goes to the client
    CLOSED = 12  # the client went away first

    @property
    def is_final(self) -> bool:
        return self >= ChoiceState.FINISHED


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2  # re-sends after a worker refused (draining, overloaded) before any token
    max_migrations: int = 2  # resumptions after a worker died or went silent
    unreachable_wait: float = 5.0  # keep trying unreachable workers this long before a 503
    first_token_timeout: float = 120.0
    idle_timeout: float = 60.0


@dataclass
class ChoiceRun:
    policy: RetryPolicy
    state: ChoiceState = ChoiceState.ROUTING
    worker_id: str = ""  # the worker of the current attempt
    tried: set[str] = field(default_factory=set)
    generated: list[int] = field(default_factory=list)  # streamed to the client so far
    refusals: int = 0
    migrations: int = 0  # resumptions, with or without tokens already streamed
    started: float = field(default_factory=time.monotonic)
    error: APIError | None = None

    @property
    def timeout(self) -> float:
        """How long to wait for this worker's next chunks."""
        p = self.policy
        return p.first_token_timeout if self.state is ChoiceState.WAITING else p.idle_timeout

    def sent(self, worker_id: str) -> None:
        self._expect(ChoiceState.ROUTING)
        self.worker_id = worker_id
        self.tried.add(worker_id)
        self.state = ChoiceState.WAITING

    def streamed(self, token_ids: list[int], finished: bool) -> None:
        """Chunks arrived (a stop string that ended the choice counts as ``finished``)."""
        self._expect(ChoiceState.WAITING, ChoiceState.STREAMING)
        self.generated.extend(token_ids)
        self.state = ChoiceState.FINISHED if finished else ChoiceState.STREAMING

    def more(self, token_ids: list[int]) -> None:
        """``streamed(token_ids, False)`` for a caller that has seen the state is STREAMING
        (``gateway.choices.direct.DirectSink``, once per token at GPU pace)."""
        self.generated.extend(token_ids)

    def refused(self, status: int, message: str, untried: bool) -> ChoiceState:
        """The worker answered with an error chunk: re-route if it only refused (503, 429)."""
        self._expect(ChoiceState.WAITING, ChoiceState.STREAMING)
        if status in (503, 429) and self.refusals < self.policy.retries and untried:
            self.refusals += 1
            self.state = ChoiceState.ROUTING
        elif status == 429:
            self._fail(APIError(429, "every worker is overloaded; retry shortly", headers={"Retry-After": "1"}))
        else:
            self._fail(upstream(status or 500, message))
        return self.state

    def lost(self, err: StreamError, untried: bool, now: float | None = None) -> ChoiceState:
        """The stream broke (the worker died, went silent, or nobody listens on its subject)."""
        self._expect(ChoiceState.WAITING, ChoiceState.STREAMING)
        now = time.monotonic() if now is None else now
        exhausted = self.migrations >= self.policy.max_migrations or not untried
        if isinstance(err, NoResponders) and exhausted and now - self.started < self.policy.unreachable_wait:
            # after a NATS restart the workers are back within a second or two
            self.state = ChoiceState.BACKOFF
        elif exhausted or err.status not in (503, 504):
            self._fail(APIError(err.status, str(err)))
        else:
            self.migrations += 1
            self.state = ChoiceState.ROUTING
        return self.state

    def backed_off(self) -> None:
        self._expect(ChoiceState.BACKOFF)
        self.tried.clear()
        self.state = ChoiceState.ROUTING

    def no_worker(self, error: APIError) -> None:
        """Routing found no live worker to send to."""
        self._expect(ChoiceState.ROUTING)
        self._fail(error)

    def closed(self) -> None:
        """The stream's consumer went away (or a stop string ended it): final, whatever the state."""
        if not self.state.is_final:
            self.state = ChoiceState.CLOSED

    def _fail(self, error: APIError) -> None:
        self.error = error
        self.state = ChoiceState.FAILED

    def _expect(self, *states: ChoiceState) -> None:
        if self.state not in states:
            raise RuntimeError(f"choice in state {self.state.name}, expected {'/'.join(s.name for s in states)}")
