"""Streaming tool-call extraction: text in, content and OpenAI ``tool_calls`` deltas out.

One state machine serves every format (``CallSyntax`` says where calls start, how they are
separated and what the envelope's keys are; ``gateway.outputs.tools`` has the formats) and both
uses: a whole message is the stream fed at once, so a parsed message and the deltas of any split
of the same text add up to the same thing by construction (the tests split at every character and
byte).

    start/content --marker, or "{" opening the message--> calls --end, "]", other text--> after
    after: content again; the blanks before a block, and those after the last one, are dropped

Inside a call the envelope ``{"name": ..., "arguments": ...}`` is scanned a character at a time
(strings, escapes, nesting): the call's id and name go out when the ``name`` value is complete,
then the ``arguments`` value is streamed raw as it arrives (a JSON string holding JSON is decoded
when it closes). A block that turns out not to be a call (no name, broken JSON) before any call
of it went out is given back as content.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.outputs.tooljson import WS, Envelope

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """One entry of an OpenAI ``delta.tool_calls``: a call's first one carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class MessageDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedMessage:
    content: str | None  # None when the message is only tool calls, as OpenAI returns it
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class CallSyntax:
    """Where a format puts its calls."""

    markers: tuple[str, ...] = ()  # open a block of calls
    bare_json: bool = False  # a message that opens with "{" is a block of calls (Llama's JSON)
    anywhere: bool = True  # markers open calls after content too (else only at the start)
    end: str = ""  # closes a block (Hermes: one call per block)
    list_open: str = ""  # "[": the block is a JSON array of calls (Mistral; a lone object is taken too)
    separator: str = ""  # between the calls of a block
    name_keys: tuple[str, ...] = ("name",)
    argument_keys: tuple[str, ...] = ("arguments", "parameters")


class ToolCallParser:
    """Feed text as it arrives, get content and tool-call deltas; ``finish()`` at the end."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str] = openai_call_id):
        self.syntax = syntax
        self.new_id = new_id
        self.mode = "start"  # start, content, calls, after, done
        self.held = ""  # start: the opening blanks and a partial marker; content: a partial marker
        self.blanks = ""  # trailing blanks of the content, out only if more content follows
        self.raw = ""  # the current block (given back as content if it is not one)
        self.marker = ""  # what opened it
        self.env: Envelope | None = None
        self.between = ""  # text after a call, until it reads as a separator or an end
        self.expect = "envelope"  # list_open, envelope, between
        self.announced = False  # the current envelope's call went out
        self.block_calls = 0
        self.num_calls = 0
        self.out = MessageDelta()

    # -- public -----------------------------------------------------------------------------
    def feed(self, text: str) -> MessageDelta:
        for ch in text:
            self._char(ch)
        return self._take()

    def finish(self) -> MessageDelta:
        if self.mode == "calls":
            if self.announced:
                self._flush_args()
            elif self.block_calls == 0:  # cut before it was a call: it is content
                self.mode = "content"
                self._content(self.raw)
        else:
            self._content(self.held)
        if self.mode in ("start", "content"):
            self.out.content += self.blanks
        self.mode, self.held, self.blanks = "done", "", ""
        return self._take()

    def parse(self, text: str) -> ParsedMessage:
        """A whole message (a fresh parser for each)."""
        return collect([self.feed(text), self.finish()])

    # -- modes ------------------------------------------------------------------------------
    def _char(self, ch: str) -> None:
        if self.mode == "calls":
            self._calls_char(ch)
        elif self.mode == "start":
            self._start_char(ch)
        else:
            self._content_char(ch)

    def _start_char(self, ch: str) -> None:
        s = self.syntax
        self.held += ch
        stripped = self.held.lstrip(WS)
        if not stripped:
            return
        if s.bare_json and stripped[0] == "{":
            self.held = ""
            self._open_block("", stripped)
            return
        for m in s.markers:
            if stripped.startswith(m):
                self.held = ""
                self._open_block(m, stripped[len(m):])
                return
            if m.startswith(stripped):
                return  # may still become the marker
        held, self.held = self.held, ""
        self.mode = "content"
        for c in held:
            self._content_char(c)

    def _content_char(self, ch: str) -> None:
        s = self.syntax
        self.held += ch
        if not s.anywhere:
            self._content(self.held)
            self.held = ""
            return
        for m in s.markers:
            if self.held.endswith(m):
                before, self.held = self.held[: -len(m)], ""
                self._content(before)
                self._open_block(m, "")
                return
        keep = max((_partial_suffix(self.held, m) for m in s.markers), default=0)
        emit = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self._content(emit)

    def _content(self, text: str) -> None:
        """Content out, less trailing blanks: they wait for more content (a block of calls drops
        them, and so does the end of a message after calls)."""
        text, self.blanks = self.blanks + text, ""
        body = text.rstrip(WS)
        self.blanks = text[len(body):]
        if not body:
            return
        if self.mode == "after":
            self.mode = "content"
        self.out.content += body

    # -- calls ------------------------------------------------------------------------------
    def _open_block(self, marker: str, rest: str) -> None:
        self.mode, self.marker, self.raw = "calls", marker, marker
        self.blanks = ""  # blanks between two blocks are not content
        self.block_calls = 0
        self.env, self.announced, self.between = None, False, ""
        self.expect = "list_open" if self.syntax.list_open else "envelope"
        for c in rest:
            if self.mode != "calls":
                self._char(c)
            else:
                self._calls_char(c)

    def _calls_char(self, ch: str) -> None:
        self.raw += ch
        if self.expect == "between":
            self._between_char(ch)
            return
        if self.expect == "list_open":
            if ch in WS:
                return
            self.expect = "envelope"
            if ch == self.syntax.list_open:
                return
        if self.env is None:
            if ch in WS:
                return
            self.env = Envelope(self.syntax.name_keys, self.syntax.argument_keys)
        env = self.env
        env.feed(ch)
        if env.broken:
            self._broken()
            return
        if env.name is not None:
            self._flush_args()
        if env.done:
            if env.name is None:
                self._broken()
                return
            self.env, self.announced = None, False
            self.block_calls += 1
            self.expect, self.between = "between", ""
            if not (self.syntax.separator or self.syntax.end or self.syntax.list_open):
                self._close_block("")

    def _between_char(self, ch: str) -> None:
        s = self.syntax
        self.between += ch
        word = self.between.strip(WS)
        if not word:
            return
        if s.separator and word == s.separator:
            self.expect, self.between = "envelope", ""
        elif (s.list_open and word == "]") or (s.end and word == s.end):
            self._close_block("")
        elif not any(t and t.startswith(word) for t in (s.separator, s.end, "]" if s.list_open else "")):
            self._close_block(self.between)  # something else: the block is over, that text is content

    def _close_block(self, rest: str) -> None:
        self.mode, self.raw, self.between = "after", "", ""
        for c in rest:
            self._char(c)

    def _broken(self) -> None:
        """Not a call after all: a block none of whose calls went out is content."""
        if self.announced:
            self._flush_args()  # the call stands with what it has; the rest of the block is dropped
            self.block_calls += 1
        if self.block_calls:
            self.env, self.announced = None, False
            self.mode, self.raw = "after", ""
            return
        raw, marker = self.raw, self.marker
        self.env, self.raw, self.mode = None, "", "content"
        self._content(marker)
        for c in raw[len(marker):]:
            self._char(c)

    def _flush_args(self) -> None:
        env = self.env
        if not self.announced:
            self.announced = True
            delta = ToolCallDelta(self.num_calls, self.new_id(), env.name, "")
            self.num_calls += 1
            self.out.tool_calls.append(delta)
        if env.args:
            fragment = "".join(env.args)
            env.args.clear()
            last = self.out.tool_calls[-1] if self.out.tool_calls else None
            if last is not None and last.index == self.num_calls - 1:
                last.arguments += fragment
            else:
                self.out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=fragment))

    def _take(self) -> MessageDelta:
        out, self.out = self.out, MessageDelta()
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def collect(deltas: list[MessageDelta]) -> ParsedMessage:
    """The message a run of deltas adds up to."""
    content = "".join(d.content for d in deltas)
    calls: list[ToolCall] = []
    for d in deltas:
        for t in d.tool_calls:
            if t.id is not None:
                calls.append(ToolCall(t.id, t.name or "", t.arguments))
            else:
                calls[t.index].arguments += t.arguments
    return ParsedMessage(content if content or not calls else None, calls)
