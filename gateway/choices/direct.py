"""Writing a choice's mid-stream tokens to its client from the reply handler.

At GPU pace every token arrives in its own step, and the indirect way costs per token: the
reply handler wakes the choice's task, which resumes ``Gateway.stream_choice``, ``sse_events``
and ``SSEResponse._send_events`` (three frames), then goes through the ASGI ``send``. A
``DirectSink`` on the ``ReplyStream`` does the same work where the chunk lands: the delta (the
choice's detokenizer and counters, as ``stream_choice`` would), its SSE event, one write.

It takes only an ordinary chunk in the middle of a stream, while the choice's task waits
for chunks with nothing queued (so every earlier event has been written), and while the
client's socket takes writes without waiting. Everything else (the first chunk, the last, an
error, a backed-up or closed socket, every chunk of a choice with stop strings) goes the indirect
way, which sees the choice's state as the sink left it.
"""

from __future__ import annotations

import time
from typing import Protocol

from gateway.choices.choice import ChoiceRun, ChoiceState
from gateway.metrics import ChoiceFigures
from mesh.protocol import TokenChunk


class DeltaWriter(Protocol):
    """Where a directly written delta goes (``gateway.streaming.SSEWriter``)."""

    def ready(self) -> bool:
        """True when ``write`` would write now, without waiting."""

    def write(self, delta) -> None: ...

    def text_frame(self, index: int) -> tuple | None:
        """How a delta of only text is framed for ``write_text`` (a ``gateway.formats.TextFrame``;
        None: it carries more, use ``write``)."""

    def write_text(self, frame: tuple, text: str) -> None:
        """What ``write`` writes for a delta of only ``text`` (not empty)."""


class DirectSink:
    """One choice's sink (``ReplyStream.sink``); ``text`` is its ``_ChoiceText``, which has no stop
    strings (a choice with some has no sink: a token may end it).

    A chunk of only tokens (no logprobs, no usage) of a choice whose deltas are only text (no
    reasoning or tool-call parser, no special tokens kept among skipped ones) and whose events
    carry only text goes the short way: detokenized, counted, written as ``write_text`` with no
    ``ChoiceDelta`` in between; everything else is the delta ``_ChoiceText.delta`` makes."""

    __slots__ = ("figures", "out", "plain", "run", "text")

    def __init__(self, out: DeltaWriter, run: ChoiceRun, text, figures: ChoiceFigures):
        self.out = out
        self.run = run
        self.text = text
        self.figures = figures
        self.plain = text.plain

    def __call__(self, chunk: TokenChunk) -> bool:
        """Write the chunk's delta and return True, or return False, having changed nothing."""
        out, run = self.out, self.run
        if (run.state is not ChoiceState.STREAMING or chunk.finish_reason is not None or chunk.error
                or not out.ready()):
            return False
        if (self.plain and not chunk.logprobs and chunk.usage is None
                and (frame := out.text_frame(self.text.index)) is not None):
            ids = chunk.token_ids
            n = len(ids)
            piece = self.text.push_plain(ids)
            run.more(ids)
        else:
            frame = None
            delta = self.text.delta([chunk])
            run.streamed(delta.token_ids, False)
            n = len(delta.token_ids)
        figures = self.figures
        figures.direct += 1
        figures.tokens += n
        now = time.monotonic()
        if n:
            figures.gap((now - figures.last_at) / n)
        figures.last_at = now
        if frame is None:
            out.write(delta)
        elif piece:
            out.write_text(frame, piece)
        return True
