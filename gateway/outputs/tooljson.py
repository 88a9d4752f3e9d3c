"""One tool-call envelope, ``{"name": ..., "arguments": ...}``, scanned a character at a time.

Strings, escapes and nesting are tracked so that the ``name`` value is known the moment it closes
and the ``arguments`` value can be handed on as it arrives (a JSON string holding JSON is decoded
when it closes). ``gateway.outputs.toolcalls`` drives it, with the keys its format uses for the
name and the arguments.
"""

from __future__ import annotations

import json

WS = " \t\r\n"


class Envelope:
    """One ``{"name": ..., "arguments": ...}`` object, a character at a time."""

    def __init__(self, name_keys: tuple[str, ...], argument_keys: tuple[str, ...]):
        self.name_keys = name_keys
        self.argument_keys = argument_keys
        self.phase = "open"  # open, key, in_key, colon, value_start, value, after_value, done
        self.broken = False
        self.name: str | None = None
        self.args: list[str] = []  # argument text not yet taken
        self._key: list[str] = []
        self._esc = False
        self._value_kind = ""  # string, container, scalar
        self._value_role = ""  # name, args, other
        self._value: list[str] = []
        self._in_str = False
        self._depth = 0

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def feed(self, ch: str) -> None:
        phase = self.phase
        if phase == "value":
            self._value_char(ch)
        elif phase == "in_key":
            self._key_char(ch)
        elif ch in WS:
            return
        elif phase == "open":
            self._expect(ch == "{", "key")
        elif phase == "key":
            self._expect(ch == '"', "in_key")
        elif phase == "colon":
            self._expect(ch == ":", "value_start")
        elif phase == "value_start":
            self._start_value(ch)
        elif phase == "after_value":
            self._expect(ch in ",}", "key" if ch == "," else "done")

    def _expect(self, ok: bool, then: str) -> None:
        if ok:
            self.phase = then
        else:
            self.broken = True

    def _key_char(self, ch: str) -> None:
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            try:
                key = json.loads('"' + "".join(self._key) + '"')
            except json.JSONDecodeError:
                self.broken = True
                return
            self._key.clear()
            self._value_role = "name" if key in self.name_keys else "args" if key in self.argument_keys else "other"
            self.phase = "colon"
            return
        self._key.append(ch)

    def _start_value(self, ch: str) -> None:
        self._value_kind = "string" if ch == '"' else "container" if ch in "[{" else "scalar"
        self._value.clear()
        self._in_str, self._depth, self._esc = ch == '"', int(ch in "[{"), False
        self.phase = "value"
        self._take(ch)

    def _value_char(self, ch: str) -> None:
        if self._value_kind == "scalar" and (ch in WS or ch in ",}"):
            self._end_value()
            self.feed(ch)
            return
        self._take(ch)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._value_kind == "string":
                    self._end_value()
        elif self._value_kind == "container":
            if ch == '"':
                self._in_str = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value()

    def _take(self, ch: str) -> None:
        if self._value_role == "args" and self._value_kind != "string":
            self.args.append(ch)  # streamed as it comes
        elif self._value_role != "other":
            self._value.append(ch)

    def _end_value(self) -> None:
        self.phase = "after_value"
        text = "".join(self._value)
        if self._value_role == "name" and self.name is None:
            name = _loads(text)
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.broken = True
        elif self._value_role == "args" and self._value_kind == "string":
            decoded = _loads(text)  # arguments as a JSON string that holds the JSON
            self.args.append(decoded if isinstance(decoded, str) else text)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
