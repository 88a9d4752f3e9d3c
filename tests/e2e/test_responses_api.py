"""The Responses API through the official ``openai`` client against ``mesh up`` (two API keys, two
tenants): whole and streamed, a function tool called and its output fed back, text.format, stored
responses retrieved and deleted, tenancy, and what pdmesh cannot run."""

from __future__ import annotations

import json
import re
import signal

import jsonschema
import nats
import openai
import pytest

from tests.helpers.cluster import start_up

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
KEYS = ("tenant-one-key", "tenant-two-key")


TTL = 600.0


@pytest.fixture(scope="module")
def up(tiny_model):
    proc, url = start_up("--model", str(tiny_model), "--prefill", "0", "--no-planner", "--responses-ttl", str(TTL),
                         *(f for k in KEYS for f in ("--api-key", k)))
    try:
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def clients(up):
    return [openai.OpenAI(base_url=f"{up[1]}/v1", api_key=k, timeout=60, max_retries=0) for k in KEYS]


def test_a_response_whole_and_streamed(clients):
    client = clients[0]
    ask = {"model": "tiny", "instructions": "Answer briefly.", "input": "Hello there, mesh",
           "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 6
    assert whole.output_text and whole.output[0].type == "message"

    events = list(client.responses.create(**ask, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text  # greedy: the same answer either way
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again


def test_a_function_call_and_its_output_fed_back(clients):
    client = clients[0]
    events = list(client.responses.create(
        model="tiny", input="What is the weather in Paris?", tools=TOOLS, max_output_tokens=48, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    assert "response.function_call_arguments.delta" in {e.type for e in events}
    called = events[-1].response
    assert events[-1].type == "response.completed" and called.status == "completed"
    (call,) = [o for o in called.output if o.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert call.name == "get_weather" and done[0].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    final = client.responses.create(
        model="tiny", previous_response_id=called.id, tools=TOOLS, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert final.previous_response_id == called.id and final.output[-1].type == "message" and final.output_text
    # the conversation so far is the new prompt's prefix: its blocks are cached
    assert final.usage.input_tokens > called.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0

    required = client.responses.create(model="tiny", input="Weather in Lyon?", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=48, temperature=0, store=False)
    assert required.output[-1].type == "function_call"
    jsonschema.validate(json.loads(required.output[-1].arguments), WEATHER)


def test_text_format_json_schema_is_valid_on_the_random_model(clients):
    out = clients[0].responses.create(
        model="tiny", input="Name a city as JSON.", max_output_tokens=48, temperature=1.0, store=False,
        text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), WEATHER)


def test_stored_responses_are_the_tenants_own(clients):
    mine, theirs = clients
    made = mine.responses.create(model="tiny", input="Remember this.", max_output_tokens=4, metadata={"k": "v"})
    got = mine.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"k": "v"}
    for attempt in (lambda: theirs.responses.retrieve(made.id), lambda: theirs.responses.delete(made.id),
                    lambda: theirs.responses.create(model="tiny", input="x", previous_response_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    mine.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made.id)
    unstored = mine.responses.create(model="tiny", input="Forget this.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)


async def test_stored_responses_live_in_the_meshs_bucket_with_its_ttl(up, clients):
    made = clients[0].responses.create(model="tiny", input="Keep this.", max_output_tokens=2)
    nc = await nats.connect(re.search(r"NATS (nats://[^\s);,]+)", up[0].up_line).group(1), connect_timeout=5)
    try:
        kv = await nc.jetstream(timeout=5).key_value("mesh_responses")
        assert (await kv.status()).ttl == TTL
        keys = await kv.keys()
        assert [k for k in keys if k.endswith(made.id)] and not any(k.startswith(KEYS[0]) for k in keys)
    finally:
        await nc.close()


@pytest.mark.parametrize("tool", [{"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["v"]},
                                  {"type": "code_interpreter", "container": {"type": "auto"}}])
def test_a_built_in_tool_is_a_400_naming_it(clients, tool):
    with pytest.raises(openai.BadRequestError) as e:
        clients[0].responses.create(model="tiny", input="x", tools=[tool])
    assert tool["type"] in e.value.body["message"] and e.value.body["param"] == "tools[0].type"


def test_the_chat_paths_errors_name_the_responses_fields(clients):
    with pytest.raises(openai.BadRequestError) as e:
        clients[0].responses.create(model="tiny", input="x", max_output_tokens=1 << 30)
    assert e.value.body["param"] == "max_output_tokens" and e.value.body["code"] == "context_length_exceeded"
