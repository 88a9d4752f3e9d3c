"""Tool-call parsing per format: whole messages, and streams split at every character and every byte
(the deltas of any split add up to the whole parse), several calls in one message, text that only
looks like a call, cut-off calls."""

from __future__ import annotations

import codecs
import itertools
import json
import random

import pytest

from gateway.outputs.toolcalls import MessageDelta, ToolCallDelta, ToolCallParser, collect
from gateway.outputs.tools import HERMES, LLAMA3_JSON, MISTRAL, TOOL_FORMATS

ARGS_A = {"city": "Zürich", "note": 'say "hi" {not a brace} \\ done', "days": [1, 2, {"x": None}]}
ARGS_B = {"tz": "Asia/Tōkyō 🕒"}

# (format, text, expected content, expected calls as (name, arguments object))
CASES = [
    (HERMES, 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS_A)
     + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": ' + json.dumps(ARGS_B, ensure_ascii=False)
     + '}\n</tool_call>', "I will check both.", [("get_weather", ARGS_A), ("get_time", ARGS_B)]),
    (HERMES, '<tool_call>\n{"arguments": {"q": 1}, "name": "late_name"}\n</tool_call>', None, [("late_name", {"q": 1})]),
    (HERMES, '<tool_call>\n{"name": "stringly", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>', None,
     [("stringly", {"a": [1, 2]})]),
    (HERMES, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (HERMES, "<tool_call>\nthis is not JSON\n</tool_call> so it is text",
     "<tool_call>\nthis is not JSON\n</tool_call> so it is text", []),
    (HERMES, 'Text first <tool_call>{"name": "f", "arguments": {}}</tool_call> and text after.',
     "Text first and text after.", [("f", {})]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": ' + json.dumps(ARGS_A) + "}", None, [("get_weather", ARGS_A)]),
    (LLAMA3_JSON, '  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "search", "parameters": {"query": "pdmesh"}}', None,
     [("search", {"query": "pdmesh"})]),
    (LLAMA3_JSON, '{"answer": 42, "unit": "none"}', '{"answer": 42, "unit": "none"}', []),
    (LLAMA3_JSON, "The answer is {probably} 42.", "The answer is {probably} 42.", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(ARGS_A) + '}, {"name": "get_time", '
     '"arguments": ' + json.dumps(ARGS_B) + ', "id": "abcdefghi"}]', None, [("get_weather", ARGS_A), ("get_time", ARGS_B)]),
    (MISTRAL, 'Let me look.[TOOL_CALLS]{"name": "f", "arguments": {"k": "v"}}', "Let me look.", [("f", {"k": "v"})]),
    (MISTRAL, "Mistral text with [TOOL_CALLS in it.", "Mistral text with [TOOL_CALLS in it.", []),
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse_chunks(fmt, chunks: list[str]) -> tuple[list[MessageDelta], object]:
    p = ToolCallParser(fmt.syntax, ids())
    deltas = [p.feed(c) for c in chunks] + [p.finish()]
    return deltas, collect(deltas)


def _check(parsed, content, calls):
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert [c.id for c in parsed.tool_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_message(fmt, text, content, calls):
    p = ToolCallParser(fmt.syntax, ids())
    _check(p.parse(text), content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_every_split_gives_the_whole_message(fmt, text, content, calls):
    whole = parse_chunks(fmt, [text])[1]
    for i in range(len(text) + 1):  # every single split point
        assert parse_chunks(fmt, [text[:i], text[i:]])[1] == whole, i
    assert parse_chunks(fmt, list(text))[1] == whole  # one character at a time
    rng = random.Random(len(text))
    for _ in range(50):  # random splits into several pieces
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(6, len(text))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert parse_chunks(fmt, pieces)[1] == whole, cuts


@pytest.mark.parametrize("fmt, text, content, calls", CASES[:1] + CASES[6:7] + CASES[11:12],
                         ids=["hermes", "llama3_json", "mistral"])
def test_a_byte_at_a_time_through_an_incremental_utf8_decoder(fmt, text, content, calls):
    """What a detokenizer hands over when a token ends inside a multi-byte character."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    chunks = [decoder.decode(data[i:i + 1]) for i in range(len(data))] + [decoder.decode(b"", final=True)]
    assert any(c == "" for c in chunks)  # some bytes completed no character
    _check(parse_chunks(fmt, chunks)[1], content, calls)


def test_deltas_are_openais_shape_and_stream_arguments_as_they_come():
    fmt, text = CASES[0][0], CASES[0][1]
    deltas, _ = parse_chunks(fmt, list(text))
    tool_deltas = [t for d in deltas for t in d.tool_calls]
    first = tool_deltas[0].to_openai()
    assert first == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    later = [t.to_openai() for t in tool_deltas[1:] if t.index == 0]
    assert len(later) > 10 and all(set(t) == {"index", "function"} for t in later)  # argument fragments
    assert "".join(t["function"]["arguments"] for t in later) == json.dumps(ARGS_A)
    content = [d.content for d in deltas if d.content]
    assert "".join(content) == "I will check both." and len(content) > 1  # content streamed too, not held


def test_a_call_cut_by_max_tokens_keeps_what_it_has():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parsed = ToolCallParser(HERMES.syntax, ids()).parse(text)
    assert parsed.content is None and parsed.tool_calls[0].arguments == '{"city": "Par'
    # cut before the name was complete: not a call, the text is content
    parsed = ToolCallParser(HERMES.syntax, ids()).parse('<tool_call>\n{"name": "get_wea')
    assert parsed.tool_calls == [] and parsed.content == '<tool_call>\n{"name": "get_wea'


def test_delta_to_openai_continuation_shape():
    assert ToolCallDelta(2, arguments='{"a"').to_openai() == {"index": 2, "function": {"arguments": '{"a"'}}


def test_mistral_ids_are_nine_alphanumerics_and_openai_ids_are_call_prefixed():
    m = MISTRAL.parser().parse('[TOOL_CALLS] [{"name": "f", "arguments": {}}]').tool_calls[0].id
    assert len(m) == 9 and m.isalnum()
    h = HERMES.parser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls[0].id
    assert h.startswith("call_") and len(h) == 29
    assert set(TOOL_FORMATS) == {"hermes", "llama3_json", "mistral"}
