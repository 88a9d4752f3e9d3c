"""The structured-output pieces between the bus and the client: the constraint on the wire and into
the engine's parameters, a choice's text through the reasoning and tool-call parsers, the chunks and
messages in OpenAI's shape (checked with the official client's types), and the special tokens the
parsers need kept when the text is detokenized."""

from __future__ import annotations

import json
import shutil

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.constraints import ConstraintKind
from gateway.completions.formats import ChatFormat
from gateway.outputs.detok import IncrementalDetokenizer
from gateway.outputs.plan import ChoiceOutput, OutputPlan, plan_chat
from gateway.outputs.reasoning import REASONING_FORMATS, ReasoningParser
from gateway.outputs.tools import HERMES, MISTRAL, ToolFormat
from gateway.requests.schemas import ChatCompletionRequest
from gateway.service import ChoiceDelta
from mesh.protocol import ConstraintSpec, GenerateRequest, SamplingOptions, decode, encode
from mesh.tokenizer import Tokenizer
from worker.base import sampling_params

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# -- the wire ------------------------------------------------------------------------------------


def test_the_constraint_travels_as_its_source_and_maps_to_the_engines():
    spec = ConstraintSpec("json_schema", '{"type": "object"}', start_after=7)
    req = GenerateRequest("r", "m", [1, 2], SamplingOptions(max_tokens=3, constraint=spec))
    back = decode(encode(req))
    assert back.sampling.constraint == spec
    params = sampling_params(back.sampling)
    c = params.constraint
    assert (c.kind, c.source, c.start_after) == (ConstraintKind.JSON_SCHEMA, '{"type": "object"}', 7)
    # free requests carry nothing (defaults are omitted on the wire) and map to no constraint
    plain = encode(GenerateRequest("r", "m", [1], SamplingOptions()))
    assert b"constraint" not in plain and sampling_params(decode(plain).sampling).constraint is None


# -- a choice's text through the parsers ----------------------------------------------------------


def _stream(output: ChoiceOutput, pieces: list[str], reason: str) -> list[ChoiceDelta]:
    deltas = [ChoiceDelta(0, p, [1]) for p in pieces]
    deltas[-1].finish_reason = reason
    for d in deltas:
        output.parse(d)
    return deltas


def _chat_format() -> ChatFormat:
    return ChatFormat("chatcmpl-x", "m", None, [[1, 2]], 1)


def _sse(fmt: ChatFormat, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
    text = fmt.opening(1) + "".join(fmt.chunks(d, True) for d in deltas)
    return [ChatCompletionChunk.model_validate_json(line[6:]) for line in text.split("\n\n") if line]


def _full(fmt: ChatFormat, deltas: list[ChoiceDelta]) -> ChatCompletion:
    return ChatCompletion.model_validate(fmt.full([deltas]))


@pytest.mark.parametrize("step", [1, 3, 7, len(CALL)])
def test_a_tool_call_streams_as_openais_deltas_and_finishes_with_tool_calls(step):
    text = "Checking. " + CALL
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = _stream(ChoiceOutput(None, HERMES.parser()), pieces, "stop")
    chunks = _sse(_chat_format(), deltas)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(t.index == 0 and t.id is None for t in calls[1:])
    arguments = "".join(t.function.arguments or "" for t in calls)
    assert json.loads(arguments) == {"city": "Zürich", "days": [1, 2]}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    whole = _full(_chat_format(), _stream(ChoiceOutput(None, HERMES.parser()), pieces, "stop"))
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Zürich", "days": [1, 2]})]
    assert msg.tool_calls[0].id.startswith("call_")


def test_two_calls_and_no_content_is_null_content_and_length_stays_length():
    deltas = _stream(ChoiceOutput(None, HERMES.parser()), [CALL, "\n", CALL.replace("Zürich", "Oslo")], "stop")
    msg = _full(_chat_format(), deltas).choices[0].message
    assert msg.content is None and [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Zürich", "Oslo"]
    assert len({c.id for c in msg.tool_calls}) == 2
    cut = _stream(ChoiceOutput(None, HERMES.parser()), [CALL[:40]], "length")
    assert cut[-1].finish_reason == "length"  # a call cut by max_tokens is not a finished call


def test_plain_text_with_a_parser_is_content_and_stop():
    deltas = _stream(ChoiceOutput(None, HERMES.parser()), ["No tools ", "today: 2 < 3."], "stop")
    whole = _full(_chat_format(), deltas)
    assert whole.choices[0].message.content == "No tools today: 2 < 3." and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"


def test_thinking_goes_to_reasoning_content_then_the_call_is_parsed():
    fmt = REASONING_FORMATS["qwen3"]
    text = "<think>\nThe user wants weather.\n</think>\n\n" + CALL
    for step in (1, 5, len(text)):
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        deltas = _stream(ChoiceOutput(ReasoningParser(fmt, False), HERMES.parser()), pieces, "stop")
        chunks = _sse(_chat_format(), deltas)
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        assert reasoning.strip() == "The user wants weather."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        full = _chat_format().full([_stream(ChoiceOutput(ReasoningParser(fmt, False), HERMES.parser()),
                                            pieces, "stop")])
        message = full["choices"][0]["message"]
        assert message["reasoning_content"].strip() == "The user wants weather." and message["content"] is None
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] == "Zürich"


def test_a_plan_without_parsers_leaves_the_text_alone():
    assert OutputPlan().choice_output() is None
    assert _chat_format().chunks(ChoiceDelta(0, "hi", [1]), True).count('"delta":{"content":"hi"}') == 1


# -- special tokens the parsers read ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_model):
    """The tiny tokenizer with Mistral's ``[TOOL_CALLS]`` as a special token, and Mistral's template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from tests.helpers.chat_templates import make_dir

    d = make_dir(tmp_path_factory.mktemp("mistral"), "mistral", tiny_model)
    hf = HFTokenizer.from_file(str(tiny_model / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    hf.save(str(d / "tokenizer.json"))
    shutil.copy(tiny_model / "config.json", d / "config.json")
    return d


def test_the_markers_that_are_special_tokens_are_kept_and_the_others_dropped(mistral_dir):
    tok = Tokenizer(mistral_dir)
    marker = tok.special_token_id("[TOOL_CALLS]")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [WEATHER]})
    plan = plan_chat(body, tok, "", None, None)
    assert isinstance(plan.tools, ToolFormat) and plan.tools is MISTRAL and marker in plan.keep_special
    ids = [marker, *tok.encode('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', add_special_tokens=False),
           tok.special_token_id("<|im_end|>")]

    def detok(**kw) -> str:
        d = IncrementalDetokenizer(tok, **kw)
        return "".join(d.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids))

    kept = detok(keep_special=plan.keep_special)
    assert kept.startswith("[TOOL_CALLS]") and "<|im_end|>" not in kept
    assert not detok().startswith("[TOOL_CALLS]")  # the default drops every special token
    deltas = _stream(plan.choice_output(), [kept], "stop")
    msg = _full(_chat_format(), deltas).choices[0].message
    assert msg.tool_calls[0].function.name == "get_weather" and msg.content is None


# -- the workers' preparation before admission -------------------------------------------------------


async def test_a_worker_prepares_the_grammar_off_the_loop_and_says_why_it_cannot():
    import time

    from engine.sampling import SamplingParams
    from mocker.engine import MockConfig, MockEngine
    from worker.base import prepare_grammar

    eng = MockEngine(MockConfig(speedup=1000, num_blocks=64))
    free = eng.new_sequence([1, 2], SamplingParams(max_tokens=2))
    assert await prepare_grammar(eng, free) is None
    seq = eng.new_sequence([1, 2], sampling_params(SamplingOptions(max_tokens=2, constraint=ConstraintSpec("json_object"))))
    assert "does not enforce constraints" in await prepare_grammar(eng, seq)  # the mocker: the worker's 400
    eng.attach_grammar = lambda s: time.sleep(0.3)  # a compile that takes too long
    assert "took over 0.05 s to compile" in await prepare_grammar(eng, seq, timeout=0.05)
