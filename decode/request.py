"""A decode worker's request record (``DecodeRequest``) and its remote prefill (``RemoteJob``).

The record's ``state`` moves only through ``decode.lifecycle``; what a remote prefill needs
beside it (the job's token, the blocks it writes, its deadline) is one ``RemoteJob``, set when
the job is sent (``decode.remote``) and None for a request prefilled here from the start.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from opentelemetry import trace

from decode.lifecycle import Event, ReqState, advance
from engine.sequence import Sequence
from mesh.protocol import GenerateRequest
from mesh.telemetry import tracer
from mesh.tracing import child_context

TRACER = tracer("pdmesh.decode")


@dataclass(slots=True, eq=False)
class RemoteJob:
    """The prefill job a request was sent as."""

    token: str  # the job's capability: its PrefillDone must carry it
    dest: list[int]  # the blocks the prefill worker writes
    deadline: asyncio.TimerHandle | None = None  # while WAITING_FOR_KV / CANCELLING: when it is too late


UNDECIDED = object()  # DecodeRequest.link before the request's first chunk


@dataclass(slots=True)
class DecodeRequest:
    """Everything the worker knows of one request; ``state`` moves only through ``move``."""

    request: GenerateRequest
    reply: str
    seq: Sequence
    arrived: float
    state: ReqState = ReqState.ADMITTING
    chunks_sent: int = 0  # the next chunk's index
    last_token_at: float = 0.0
    remote: RemoteJob | None = None  # its prefill job, once one was sent
    span: trace.Span | None = None  # decode.request: arrival to the last token
    phase: trace.Span | None = None  # its current child: prefill.local | prefill.remote | decode
    overflow: bool = False  # prefilled here although meant for the prefill pool (no room, or a fallback)
    # the token link its chunks take (mesh.tokenlink), chosen at its first chunk; None: the bus
    link: object = UNDECIDED

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def move(self, event: Event) -> ReqState:
        self.state = advance(self.state, event)
        return self.state

    def enter(self, name: str, **attributes) -> trace.Span:
        """End the current phase span and start the next one under the request's span."""
        if self.phase is not None:
            self.phase.end()
        self.phase = TRACER.start_span(name, context=child_context(self.span), attributes=attributes)
        return self.phase

    def end_spans(self, outcome: str, **attributes) -> None:
        if self.phase is not None:
            self.phase.end()
            self.phase = None
        if self.span is not None:
            self.span.set_attributes({"pdmesh.outcome": outcome, **attributes})
            self.span.end()
            self.span = None
