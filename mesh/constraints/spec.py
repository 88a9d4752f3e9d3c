"""What a request asks its output to match: a ``Constraint``, a plain value.

A constraint travels with the request (in ``SamplingParams``, and on the wire
as ``mesh.protocol.ConstraintSpec``) as its source text, never as a token mask: whichever worker samples
a token compiles it against its own tokenizer (cached) and rebuilds the
matcher from the tokens generated so far. Torch-free and grammar-engine-free,
so the gateway and the mocker import it without either.

Kinds:

- ``json_schema``: ``source`` is a JSON Schema (JSON text).
- ``json_object``: any JSON object (OpenAI's ``{"type": "json_object"}``); no source.
- ``regex``: the whole output matches ``source``.
- ``lark``: ``source`` is a grammar in llguidance's Lark dialect (``%json {...}``
  inline schemas, ``<[id]>`` special tokens); the tool-call grammars are these.

``start_after``: a token id (a reasoning model's end-of-thinking token); the
output is free until the model emits it, and the grammar applies to what
follows.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from mesh.errors import RequestError

MAX_SOURCE_CHARS = 1 << 20  # a schema or grammar larger than this is refused, not compiled
# JSON is generated in one style, ``{"a": 1, "b": [2, 3]}`` (the separators most models were trained
# on, and OpenAI's), with no free whitespace: a model cannot stall in an endless run of blanks.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class ConstraintError(RequestError):
    """A constraint that cannot be compiled or enforced (the message says why)."""


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    LARK = "lark"


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    source: str = ""
    start_after: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = ConstraintKind(self.kind)
        except ValueError:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} "
                                  f"(choose from {', '.join(k.value for k in ConstraintKind)})") from None
        object.__setattr__(self, "kind", kind)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ConstraintError(f"the {kind.value} constraint is over {MAX_SOURCE_CHARS} characters")
        if kind is ConstraintKind.JSON_OBJECT:
            if self.source:
                raise ConstraintError("a json_object constraint takes no source")
        elif not self.source:
            raise ConstraintError(f"a {kind.value} constraint needs a source")
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ConstraintError("a JSON schema must be an object or a boolean")
        if self.start_after is not None and self.start_after < 0:
            raise ConstraintError("start_after must be a token id")

    # -- builders ----------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | bool | str, start_after: int | None = None) -> Constraint:
        """``schema`` as given (property order is the order the output follows)."""
        source = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"),
                                                                    ensure_ascii=False)
        return cls(ConstraintKind.JSON_SCHEMA, source, start_after)

    @classmethod
    def json_object(cls, start_after: int | None = None) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT, "", start_after)

    @classmethod
    def regex(cls, pattern: str, start_after: int | None = None) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern, start_after)

    @classmethod
    def lark(cls, grammar: str, start_after: int | None = None) -> Constraint:
        return cls(ConstraintKind.LARK, grammar, start_after)

    @property
    def grammar_key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by (``start_after`` is not part of the grammar)."""
        return (self.kind.value, self.source)


def lark_json(schema: dict | bool) -> str:
    """A JSON schema inline in a Lark grammar (``%json {...}``), in the engine's JSON style."""
    body = {"anyOf": [schema]} if isinstance(schema, bool) else schema
    return "%json " + json.dumps({**body, "x-guidance": JSON_STYLE}, separators=(",", ":"), ensure_ascii=False)
