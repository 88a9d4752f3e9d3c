"""Can the grammar engine enforce this? Checked where requests come in (the gateway), without a
tokenizer and without torch: the same compiler the engine runs, minus the vocabulary."""

from __future__ import annotations

import json

import llguidance as llg

from mesh.constraints.spec import JSON_STYLE, MAX_SOURCE_CHARS


def schema_problem(schema: object) -> str | None:
    """Why ``schema`` cannot be enforced as a JSON schema (None: it can)."""
    if not isinstance(schema, dict | bool):
        return "a JSON schema must be an object or a boolean"
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SOURCE_CHARS:
        return f"it is over {MAX_SOURCE_CHARS} characters"
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
    except ValueError as e:
        return first_line(str(e))
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    return first_line(messages[0]) if is_error else None


def grammar_problem(lark: str) -> str | None:
    """Why a Lark grammar (llguidance's dialect) cannot be enforced (None: it can)."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(lark))
    return first_line(messages[0]) if is_error else None


def first_line(message: str) -> str:
    """llguidance's messages carry a dump of the grammar after the first line; users get the line
    (and, for a regex, the line that says what is wrong with it)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "rejected by the grammar engine"
    line = lines[0]
    if line.endswith(":"):
        line += " " + next((ln for ln in lines[1:] if ln.startswith("error:")), " ".join(lines[1:3]))
    return line[:500]
