"""Chat templates with tools: ours renders what transformers' ``apply_chat_template`` renders, and
the tool calls the real templates write into an assistant turn parse back into the same calls.

The templates are Qwen2.5's (Hermes ``<tool_call>``), Llama 3.1's (JSON) and Mistral v0.3's
(``[TOOL_CALLS]``), as their tokenizer_config.json ship them (tests/data/chat_templates), on
tokenizer directories made from the tiny model's tokenizer (no downloads).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.outputs.tools import TOOL_FORMATS, tool_format
from gateway.requests.schemas import ChatCompletionRequest
from mesh.tokenizer import ChatTemplateError, Tokenizer
from tests.helpers.chat_templates import FAMILIES, make_dir, make_plain_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place <today> & tomorrow",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {f: make_dir(root, f, tiny_model) for f in FAMILIES}


def hf_render(d: Path, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
    from transformers import PreTrainedTokenizerFast

    _, _, bos, eos, _, _ = FAMILIES[d.name]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token=bos, eos_token=eos)
    template = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def request(messages: list[dict], tools: list[dict] | None = None) -> ChatCompletionRequest:
    """The conversation as the OpenAI API sends it, through our validation."""
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools,
                                                 "tool_choice": "none" if tools else None})


def conversation(ids: tuple[str, str]) -> list[dict]:
    """A tool round trip: the user asks, the assistant calls, the tool answers."""
    calls = [{"id": ids[0], "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": ids[0], "content": '{"temp": 21}'},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_a_tool_round_trip_render_as_transformers_renders_them(dirs, family):
    d = dirs[family]
    tok = Tokenizer(d)
    assert tok.template_uses_tools
    ids = ("abcdefghi", "jklmnopqr")  # Mistral's templates want nine characters
    body = request(conversation(ids), [WEATHER, TIME])
    messages, tools = body.template_messages(), body.template_tools()
    if family == "llama3_1":  # its template keeps the tool result in the last turn; add a user turn
        messages.append({"role": "user", "content": "And in Rome?"})
    if family == "mistral":
        messages = messages[1:]  # system first, then strictly alternating: keep it simple
    ours = tok.render_chat(messages, tools=tools)
    assert ours == hf_render(d, messages, tools)
    assert "get_time" in ours and "Weather at a place <today> & tomorrow" in ours  # tojson does not HTML-escape


@pytest.mark.parametrize("family", FAMILIES)
def test_the_format_is_found_in_the_template(dirs, family):
    assert tool_format(Tokenizer(dirs[family]).chat_template).name == FAMILIES[family][1]


def test_the_override_wins_and_unknown_names_are_refused(dirs):
    assert tool_format(Tokenizer(dirs["qwen2_5"]).chat_template, "mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        tool_format(None, "pythonic")
    assert tool_format("{{ messages }}") is None


def test_a_template_that_cannot_render_tools_says_so(tmp_path, tiny_model):
    tok = Tokenizer(make_plain_dir(tmp_path, tiny_model))
    assert not tok.template_uses_tools
    with pytest.raises(ChatTemplateError) as e:
        tok.render_chat([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert e.value.param == "tools"


def assistant_turn(family: str, rendered: str, before: str) -> str:
    """What the model wrote: the conversation rendered with its last (assistant) turn, less the
    conversation before it with the generation prompt, up to the end-of-turn marker."""
    assert rendered.startswith(before)
    ends = FAMILIES[family][5]
    tail = rendered[len(before):]
    return tail[: tail.index(ends)] if ends in tail else tail


@pytest.mark.parametrize("family, calls", [
    ("qwen2_5", 1), ("qwen2_5", 3), ("llama3_1", 1), ("mistral", 1), ("mistral", 3),
])
def test_calls_the_real_templates_write_parse_back(dirs, family, calls):
    d = dirs[family]
    tok = Tokenizer(d)
    args = [{"city": "Paris", "unit": "celsius"}, {"tz": "Europe/Rome"}, {"city": 'Q"uo\\te', "n": [1, {"x": None}]}]
    names = ["get_weather", "get_time", "get_weather"]
    ids = ["abcdefgh" + str(i) for i in range(calls)]
    history = [{"role": "user", "content": "Weather and time?"}]
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": ids[i], "type": "function", "function": {"name": names[i], "arguments": json.dumps(args[i])}}
        for i in range(calls)]}
    body = request(history + [turn], [WEATHER, TIME])
    before = tok.render_chat(body.template_messages()[:-1], tools=body.template_tools(), add_generation_prompt=True)
    rendered = tok.render_chat(body.template_messages(), tools=body.template_tools(), add_generation_prompt=False)
    written = assistant_turn(family, rendered, before)
    parsed = TOOL_FORMATS[FAMILIES[family][1]].parser().parse(written)
    assert parsed.content is None, written
    assert [c.name for c in parsed.tool_calls] == names[:calls]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == args[:calls]


def test_the_default_tiny_model_renders_tools_in_hermes(tiny_model):
    tok = Tokenizer(tiny_model)
    assert tok.template_uses_tools and tool_format(tok.chat_template).name == "hermes"
    assert "<tool_call>" in tok.render_chat([{"role": "user", "content": "hi"}], tools=[WEATHER])
