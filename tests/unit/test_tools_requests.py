"""Structured-output requests: typed fields, 400s in OpenAI's shape naming the field, refused fields,
and the output plan (constraint, parsers) built from a model's template."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from engine.constraints import ConstraintKind
from gateway import errors
from gateway.errors import APIError
from gateway.outputs.plan import plan_chat, plan_completion
from gateway.requests.output_schemas import REFUSED
from gateway.requests.schemas import ChatCompletionRequest, CompletionRequest
from mesh.tokenizer import Tokenizer
from tests.helpers.chat_templates import make_dir, make_plain_dir

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, **fields}))


def error_of(**fields) -> dict:
    with pytest.raises(ValidationError) as e:
        chat(**fields)
    return errors.from_pydantic(e.value).body()["error"]


@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema", "cannot be enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "unevaluatedProperties": False}}}}, "response_format.json_schema.schema", "unevaluatedProperties"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}},
     "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time', which is not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/nope"}}}}}]}, "tools.0.function.parameters", "does not exist"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", ""),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tool_choice auto"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0", "assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function", "JSON"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "cannot set 'tools'"),
])
def test_bad_structured_fields_are_400s_naming_the_field(fields, param, says):
    err = error_of(**fields)
    assert err["param"] == param and says in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"50256": -100}), ("guided_json", SCHEMA), ("guided_choice", ["a", "b"]),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("best_of", 2), ("reasoning_effort", "high"),
    ("modalities", ["text", "audio"]), ("echo", True), ("skip_special_tokens", False),
])
def test_fields_that_change_the_output_and_are_not_implemented_are_refused(field, value):
    err = error_of(**{field: value})
    assert err["param"] == field and err["code"] == "unsupported_parameter" and field in err["message"]
    assert field in REFUSED


def test_harmless_values_and_unknown_fields_pass():
    body = chat(logit_bias={}, best_of=1, modalities=["text"], metadata={"k": "v"}, store=False,
                service_tier="auto", prediction={"type": "content", "content": "x"}, frobnicate=1)
    assert body.model == "m"
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True}).echo  # declared there


def test_typed_fields():
    body = chat(tools=[WEATHER, {"type": "function", "function": {"name": "ping"}}],
                tool_choice={"type": "function", "function": {"name": "ping"}}, parallel_tool_calls=False,
                response_format={"type": "text"})
    assert body.tool_choice_mode == "named" and [f.name for f in body.forced_tools] == ["ping"]
    assert not body.parallel and not body.wants_json
    assert chat(tools=[WEATHER]).tool_choice_mode == "auto" and chat().tool_choice_mode == "none"
    assert chat(tools=[WEATHER], tool_choice="required").forced_tools[0].parameters == WEATHER["function"]["parameters"]
    rf = chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    assert rf.wants_json and rf.response_format.json_schema.schema_ == SCHEMA


def test_tool_call_history_reaches_the_template_as_templates_expect():
    body = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3C"}], tools=[WEATHER], tool_choice="none")
    msgs = body.template_messages()
    assert msgs[0] == {"role": "user", "content": "weather?"}  # no tool_calls key at all
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, not text
    assert msgs[2] == {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}
    assert body.template_tools() == [WEATHER]


async def test_the_http_surface_answers_in_openais_shape(tiny_model):
    from gateway.app import asgi_app
    from gateway.service import Gateway, GatewayConfig

    app = asgi_app(Gateway(GatewayConfig(nats_url="nats://127.0.0.1:1", model_dirs=(str(tiny_model),))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        r = await http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = await http.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"1": 5}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"


# -- the output plan ---------------------------------------------------------------------------

REASONING_TEMPLATE = (  # the shape of Qwen3's: the model opens <think>, or the template closes it
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, tiny_model) -> Tokenizer:
    return Tokenizer(make_dir(tmp_path_factory.mktemp("plan"), "qwen2_5", tiny_model))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_model) -> Tokenizer:
    """A reasoning model's tokenizer: the tiny vocabulary plus <think> and </think> as added tokens."""
    d = tmp_path_factory.mktemp("thinker")
    tok = json.loads((tiny_model / "tokenizer.json").read_text())
    for i, t in enumerate(("<think>", "</think>")):
        tok["added_tokens"].append({"id": 4094 + i, "content": t, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": REASONING_TEMPLATE}))
    return Tokenizer(d)


def test_plan_for_required_tools_is_a_grammar_in_the_models_format(qwen):
    body = chat(tools=[WEATHER], tool_choice="required")
    plan = plan_chat(body, qwen, qwen.render_chat(body.template_messages(), tools=body.template_tools()))
    assert plan.constraint.kind == ConstraintKind.LARK and "<tool_call>" in plan.constraint.source
    assert plan.tools.name == "hermes" and plan.reasoning is None and plan.constraint.start_after is None
    auto = plan_chat(chat(tools=[WEATHER]), qwen, "")
    assert auto.constraint is None and auto.tool_parser() is not None
    assert plan_chat(chat(tools=[WEATHER], tool_choice="none"), qwen, "").tools is None


def test_plan_for_json_output(qwen, thinker):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    plan = plan_chat(body, qwen, "")
    assert plan.constraint.kind == ConstraintKind.JSON_SCHEMA and json.loads(plan.constraint.source) == SCHEMA
    assert plan_completion(CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})).constraint.kind == "json_object"


def test_a_thinking_model_gets_its_constraint_after_the_thinking(thinker):
    body = chat(response_format={"type": "json_object"})
    thinking = thinker.render_chat(body.template_messages())
    plan = plan_chat(body, thinker, thinking)
    assert plan.reasoning is not None and plan.constraint.start_after == thinker.token_to_id("</think>")
    assert not plan.starts_thinking  # this model opens <think> itself
    closed = thinker.render_chat(body.template_messages(), template_kwargs={"enable_thinking": False})
    plan = plan_chat(body, thinker, closed)
    assert plan.constraint.start_after is None  # the template closed the block: the grammar applies at once


def test_a_model_without_a_known_tool_format_cannot_take_tools(tmp_path, tiny_model):
    tok = Tokenizer(make_plain_dir(tmp_path, tiny_model))
    with pytest.raises(APIError) as e:
        plan_chat(chat(tools=[WEATHER], tool_choice="required"), tok, "")
    assert e.value.status == 400 and e.value.param == "tools"
    assert plan_chat(chat(tools=[WEATHER], tool_choice="required"), tok, "", tool_override="hermes").constraint


def test_an_unknown_override_is_the_operators_error(qwen):
    with pytest.raises(APIError) as e:
        plan_chat(chat(), qwen, "", tool_override="pythonic")
    assert e.value.status == 500


def test_the_template_fixtures_exist():
    assert sorted(p.name for p in (Path(__file__).parents[1] / "data" / "chat_templates").iterdir()) == [
        "llama3_1.jinja", "mistral_v0_3.jinja", "plain.jinja", "qwen2_5.jinja"]
