"""Tool-call formats of the model families we serve: detection, parsing, and the forcing grammar.

| format        | what the model writes                                              | families |
|---------------|--------------------------------------------------------------------|----------|
| ``hermes``    | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per call | Qwen2.5, Qwen3, Hermes |
| ``llama3_json`` | ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), ``;`` between calls | Llama 3.1-3.3 |
| ``mistral``   | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``           | Mistral v0.3 and later instruct |

A model's format is found in its chat template (the markers above), or named by the operator's
override. ``tool_choice="required"`` or a named function is enforced with a grammar in
llguidance's Lark dialect (``forcing_grammar``): the model must write calls in its own format,
with arguments that validate against each function's ``parameters``. ``auto`` lets the model
choose, and the parser takes what it wrote.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

from gateway.outputs.toolcalls import CallSyntax, ToolCallParser, openai_call_id
from mesh.constraints.spec import Constraint, lark_json

_ALNUM = string.ascii_letters + string.digits
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def mistral_call_id() -> str:
    """Mistral's templates refuse any id but nine letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    description: str | None = None
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


@dataclass(frozen=True)
class ToolFormat:
    name: str
    syntax: CallSyntax
    detect: tuple[str, ...]  # any of these in a chat template means this format
    arguments_key: str  # the envelope key the model writes its arguments under
    call_open: str = ""  # around each call, in the grammar
    call_close: str = ""
    joiner: str = ""  # between two calls, in the grammar
    block_open: str = ""  # before the calls (Mistral's marker), in the grammar
    after_open: str = ""  # between that marker and the calls (Mistral's templates write a blank)
    as_list: bool = False  # the calls are one JSON array
    new_id: Callable[[], str] = openai_call_id

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.syntax, self.new_id)

    def forcing_grammar(self, functions: list[FunctionSpec], parallel: bool,
                        special_token_id: Callable[[str], int | None]) -> str:
        """A grammar whose every output is one call (or, ``parallel``, one or more) of ``functions``
        in this format, with valid arguments. ``special_token_id`` finds the markers that are
        special tokens of the model's tokenizer (they must be that token, not its spelling)."""
        envelope = {"anyOf": [self._envelope(f) for f in functions]}
        if self.as_list:
            array = {"type": "array", "items": envelope, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            opening = " ".join(p for p in (_literal(self.block_open, special_token_id), _literal(self.after_open, _none)) if p)
            return f"start: {opening} {lark_json(array)}\n"
        call = " ".join(p for p in (_literal(self.call_open, special_token_id), "env",
                                    _literal(self.call_close, special_token_id)) if p)
        more = f" ({_literal(self.joiner, special_token_id)} call)*" if parallel else ""
        return f"start: call{more}\ncall: {call}\nenv: {lark_json(envelope)}\n"

    def _envelope(self, f: FunctionSpec) -> dict:
        return {"type": "object", "properties": {"name": {"const": f.name}, self.arguments_key: f.arguments_schema},
                "required": ["name", self.arguments_key], "additionalProperties": False}


def _none(text: str) -> None:
    return None


def _literal(text: str, special_token_id: Callable[[str], int | None]) -> str:
    if not text:
        return ""
    tid = special_token_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


HERMES = ToolFormat(
    "hermes", CallSyntax(markers=("<tool_call>",), end="</tool_call>"), detect=("<tool_call>",),
    arguments_key="arguments", call_open="<tool_call>\n", call_close="\n</tool_call>", joiner="\n",
)
LLAMA3_JSON = ToolFormat(
    "llama3_json", CallSyntax(markers=("<|python_tag|>",), bare_json=True, anywhere=False, separator=";"),
    detect=("<|python_tag|>", "Environment: ipython"), arguments_key="parameters", joiner="; ",
)
MISTRAL = ToolFormat(
    "mistral", CallSyntax(markers=("[TOOL_CALLS]",), list_open="[", separator=","), detect=("[TOOL_CALLS]",),
    arguments_key="arguments", block_open="[TOOL_CALLS]", after_open=" ", as_list=True, new_id=mistral_call_id,
)
TOOL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def tool_format(chat_template: str | None, override: str | None = None) -> ToolFormat | None:
    """The format named by ``override``, else the one the template's markers show (None: unknown)."""
    if override:
        try:
            return TOOL_FORMATS[override]
        except KeyError:
            raise ValueError(f"unknown tool-call format {override!r} (choose from {', '.join(TOOL_FORMATS)})") from None
    if not chat_template:
        return None
    for f in TOOL_FORMATS.values():
        if any(marker in chat_template for marker in f.detect):
            return f
    return None


def forcing_constraint(fmt: ToolFormat, functions: list[FunctionSpec], parallel: bool,
                       special_token_id: Callable[[str], int | None], start_after: int | None = None) -> Constraint:
    """The engine constraint for ``tool_choice="required"`` (all functions) or a named function."""
    return Constraint.lark(fmt.forcing_grammar(functions, parallel, special_token_id), start_after)
