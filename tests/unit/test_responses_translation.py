"""The Responses API without processes: requests as chat requests (items -> messages, tools,
text.format), what is refused (built-in tools, unknown fields), and the output as the Response
object and the typed event sequence the openai client parses."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.auth import ApiKey, KeyLimits
from gateway.errors import APIError
from gateway.outputs.plan import OutputPlan
from gateway.outputs.reasoning import THINK
from gateway.outputs.toolcalls import ToolCallDelta
from gateway.outputs.tools import tool_format
from gateway.responses.conversations import tenant_of
from gateway.responses.items import chat_request, output_messages
from gateway.responses.routes import echo, parse_request
from gateway.responses.schema import ResponsesRequest
from gateway.responses.stream import ResponseFormat
from gateway.service import ChoiceDelta
from mesh.protocol import Usage

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EVENTS = TypeAdapter(ResponseStreamEvent)


def parse(**body) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "tiny", **body}).encode())


def refused(**body) -> APIError:
    with pytest.raises(APIError) as e:
        chat_request(parse(**body), [])
    assert e.value.status == 400
    return e.value


def test_a_string_input_is_a_user_message_after_the_instructions():
    chat = chat_request(parse(input="Hi there", instructions="Be brief", max_output_tokens=7, temperature=0.5), [])
    assert chat.template_messages() == [{"role": "system", "content": "Be brief"},
                                        {"role": "user", "content": "Hi there"}]
    assert (chat.max_output, chat.temperature, chat.tools, chat.response_format) == (7, 0.5, None, None)


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "before"}]
    chat = chat_request(parse(input=items), history)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for i, c in ((1, "Paris"), (2, "Lyon"))]
    assert chat.template_messages() == [
        *history,
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls, "reasoning_content": "hmm"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
    ]


def test_tools_tool_choice_and_text_format_map_to_the_chat_fields():
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    chat = chat_request(parse(input="x", tools=tools, tool_choice={"type": "function", "name": "get_weather"}), [])
    assert [f.name for f in chat.forced_tools] == ["get_weather"] and chat.tools[0].function.parameters == WEATHER
    assert chat_request(parse(input="x", tools=tools, tool_choice="required"), []).tool_choice_mode == "required"
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}
    chat = chat_request(parse(input="x", text={"format": fmt}), [])
    assert chat.wants_json and chat.response_format.json_schema.schema_ == WEATHER
    assert chat_request(parse(input="x", text={"format": {"type": "json_object"}}), []).response_format.type == \
        "json_object"


@pytest.mark.parametrize(("body", "param", "named"), [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", "web_search_preview"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "code_interpreter", "container": {"type": "auto"}}]},
     "tools[1].type", "code_interpreter"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"background": True}, "background", "background"),
    ({"frobnicate": 1}, "frobnicate", "frobnicate"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading", "defer_loading"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments",
     "JSON"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "x"}]},
     "input[1].call_id", "input[1]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
      "tools": [{"type": "function", "name": "f"}]}, "text.format", "text.format"),
])
def test_what_we_cannot_do_is_a_400_naming_it(body, param, named):
    e = refused(**{"input": "x", **body})
    assert e.param == param and named in e.message, e.body()


def delta(text="", reasoning="", calls=None, finish=None) -> ChoiceDelta:
    usage = Usage(11, 6, 4) if finish else None
    return ChoiceDelta(0, text, [1], [], finish, usage, reasoning, calls)


DELTAS = [delta(reasoning="Let me "), delta(reasoning="think."), delta(text="Calling "), delta(text="now."),
          delta(calls=[ToolCallDelta(0, "call_a", "get_weather", '{"city":')]),
          delta(calls=[ToolCallDelta(0, None, None, '"Paris"}')]),
          delta(calls=[ToolCallDelta(1, "call_b", "get_time", "{}")], finish="tool_calls")]


def formatter(saved: list) -> ResponseFormat:
    async def save(response):
        saved.append(response)

    body = parse(input="x", tools=[{"type": "function", "name": "get_weather"}, {"type": "function", "name": "get_time"}])
    return ResponseFormat("resp_" + "0" * 32, [1] * 11, echo(body), save)


async def stream(fmt: ResponseFormat, deltas) -> list[dict]:
    text = fmt.opening(1) + "".join(fmt.chunks(d, True) for d in deltas)
    text += "".join([t async for t in fmt.closing(False)])
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the client's own types, strictly
        events.append(event)
    return events


def test_the_stream_is_the_typed_event_sequence_and_adds_up_to_the_response():
    saved: list = []
    events = asyncio.run(stream(formatter(saved), DELTAS))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    item = ["response.output_item.added", "response.content_part.added"]
    item_done = ["response.content_part.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        *item_done,
        *item, "response.output_text.delta", "response.output_text.delta", "response.output_text.done", *item_done,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert saved == [final]  # stored before the client hears it completed
    whole = formatter([]).full([DELTAS])
    for r in (final, whole):
        parsed = Response.model_validate(r)
        assert parsed.status == "completed" and parsed.output_text == "Calling now."
        assert [o.type for o in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
        assert parsed.output[0].content[0].text == "Let me think."
        assert [(o.call_id, o.name, o.arguments) for o in parsed.output[2:]] == [
            ("call_a", "get_weather", '{"city":"Paris"}'), ("call_b", "get_time", "{}")]
        assert parsed.usage.input_tokens == 11 and parsed.usage.output_tokens == 6
        assert parsed.usage.input_tokens_details.cached_tokens == 4
    # the output fed back as input is the assistant turn the template saw
    assert output_messages(whole["output"]) == [
        {"role": "assistant", "content": "Calling now.", "reasoning_content": "Let me think.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]


def test_output_items_fed_back_as_input_are_the_same_turn():
    """An agent loop sends the output back itself (the client dumps the parsed items): the same
    chat messages as the stored history would give."""
    whole = formatter([]).full([DELTAS])
    items = [o.model_dump(mode="json", exclude_unset=True) for o in Response.model_validate(whole).output]
    outputs = [{"type": "function_call_output", "call_id": "call_a", "output": "sunny"}]
    chat = chat_request(parse(input=[*items, *outputs]), [])
    assert chat.template_messages()[:-1] == [
        {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]} for m in output_messages(whole["output"])]


def test_the_reasoning_and_tool_call_parsers_make_the_items():
    """The chat path's parsers (a thinking model with Hermes calls) split the raw text the worker
    sent; the items follow what they found, at any split of the text."""
    plan = OutputPlan(tools=tool_format(None, "hermes"), reasoning=THINK)
    text = '<think>\nWhich city?\n</think>\n\nLet me look.<tool_call>\n{"name": "get_weather", ' \
           '"arguments": {"city": "Oslo"}}\n</tool_call>'
    for size in (1, 7, len(text)):
        reader = plan.choice_output()
        deltas = []
        for i in range(0, len(text), size):
            d = delta(text=text[i:i + size], finish="stop" if i + size >= len(text) else None)
            reader.parse(d)
            deltas.append(d)
        out = Response.model_validate(formatter([]).full([deltas]))
        assert [o.type for o in out.output] == ["reasoning", "message", "function_call"], size
        assert out.output[0].content[0].text == "Which city?" and out.output_text == "Let me look."
        assert json.loads(out.output[2].arguments) == {"city": "Oslo"} and out.status == "completed"


def test_a_call_cut_short_is_left_out_of_the_stored_history():
    cut = formatter([]).full([[delta(calls=[ToolCallDelta(0, "call_a", "get_weather", '{"city": "Os')],
                                     finish="length")]])
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
    assert output_messages(cut["output"]) == []


def test_a_response_cut_by_max_output_tokens_is_incomplete_and_an_error_fails_it():
    events = asyncio.run(stream(formatter([]), [delta(text="abc", finish="length")]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    saved: list = []
    fmt = formatter(saved)

    async def failing():
        text = fmt.opening(1) + fmt.chunks(delta(text="a"), True) + fmt.error_event(APIError(504, "too slow"))
        return text + "".join([t async for t in fmt.closing(False)])

    text = asyncio.run(failing())
    assert '"type":"error"' in text and text.rstrip().endswith("}") and "response.failed" in text
    assert saved == []  # a failed response is not stored


def test_a_stream_whose_response_cannot_be_stored_fails_instead_of_completing():
    async def unavailable(response):
        raise APIError(503, "the response store is unavailable (put); retry shortly")

    fmt = formatter([])
    fmt.save = unavailable
    events = asyncio.run(stream(fmt, [delta(text="abc", finish="stop")]))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"].startswith("the response store is unavailable")


def test_tenants_get_their_own_keys():
    def key(name, tenant=""):
        return ApiKey(name, name.encode() * 4, KeyLimits(), tenant=tenant)

    secret = b"s" * 32
    assert tenant_of(key("a", "acme"), secret) == tenant_of(key("b", "acme"), secret)
    assert len({tenant_of(k, secret) for k in (key("a"), key("b"), key("c", "acme"), None)}) == 4
