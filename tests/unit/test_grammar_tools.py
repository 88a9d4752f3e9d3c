"""Forced tool calls through the engine: ``tool_choice="required"`` or a named function compiles to a
grammar in the model's own call format; the tiny random model, which left alone writes no call,
writes calls that the gateway's parser reads back, with arguments that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus
from gateway.outputs.toolcalls import ToolCallParser
from gateway.outputs.tools import TOOL_FORMATS, FunctionSpec, forcing_constraint
from mesh.constraints.validate import grammar_problem
from mesh.tokenizer import Tokenizer

FUNCTIONS = [
    FunctionSpec("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}),
    FunctionSpec("get_time", {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                              "required": ["tz"], "additionalProperties": False}),
    FunctionSpec("ping"),  # no parameters: the arguments are {}
]


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=512))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": "What is the weather in Paris?"}])


def _calls(fmt, text: str):
    parsed = ToolCallParser(fmt.syntax).parse(text)
    by_name = {f.name: f for f in FUNCTIONS}
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name].arguments_schema)
    return parsed


@pytest.mark.parametrize("fmt", TOOL_FORMATS.values(), ids=TOOL_FORMATS)
def test_the_forcing_grammars_are_valid(fmt, tok):
    for functions, parallel in ((FUNCTIONS, True), (FUNCTIONS[:1], False)):
        assert grammar_problem(fmt.forcing_grammar(functions, parallel, tok.special_token_id)) is None


@pytest.mark.parametrize("fmt", TOOL_FORMATS.values(), ids=TOOL_FORMATS)
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_required_gives_one_valid_call_of_any_function(engine, tok, prompt, fmt, sampling):
    c = forcing_constraint(fmt, FUNCTIONS, parallel=False, special_token_id=tok.special_token_id)
    seq = engine.generate([prompt], SamplingParams(max_tokens=150, constraint=c, **sampling))[0]
    text = tok.decode(seq.output_token_ids)
    assert seq.status == SeqStatus.FINISHED_STOPPED, text
    parsed = _calls(fmt, text)
    assert len(parsed.tool_calls) == 1 and parsed.content is None, text


@pytest.mark.parametrize("fmt", TOOL_FORMATS.values(), ids=TOOL_FORMATS)
def test_a_named_function_is_the_one_called(engine, tok, prompt, fmt):
    c = forcing_constraint(fmt, [FUNCTIONS[1]], parallel=False, special_token_id=tok.special_token_id)
    seq = engine.generate([prompt], SamplingParams(max_tokens=150, temperature=0.0, constraint=c))[0]
    parsed = _calls(fmt, tok.decode(seq.output_token_ids))
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


@pytest.mark.parametrize("fmt", TOOL_FORMATS.values(), ids=TOOL_FORMATS)
def test_parallel_calls_are_each_valid(engine, tok, prompt, fmt):
    """With parallel calls allowed the random model may go on calling until max_tokens; every call
    it finished validates."""
    c = forcing_constraint(fmt, FUNCTIONS, parallel=True, special_token_id=tok.special_token_id)
    seq = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=1.0, seed=3, constraint=c))[0]
    text = tok.decode(seq.output_token_ids)
    parsed = ToolCallParser(fmt.syntax).parse(text)
    assert parsed.tool_calls, text
    finished = parsed.tool_calls if seq.status == SeqStatus.FINISHED_STOPPED else parsed.tool_calls[:-1]
    by_name = {f.name: f for f in FUNCTIONS}
    for call in finished:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name].arguments_schema)


def test_without_the_grammar_the_model_calls_nothing(engine, tok, prompt):
    seq = engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0))[0]
    for fmt in TOOL_FORMATS.values():
        assert not ToolCallParser(fmt.syntax).parse(tok.decode(seq.output_token_ids)).tool_calls


def test_a_forced_call_after_thinking(engine, tok, prompt):
    """A reasoning model: the call is forced only after the end-of-thinking token."""
    free = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))[0].output_token_ids
    marker = free[2]
    fmt = TOOL_FORMATS["hermes"]
    c = forcing_constraint(fmt, FUNCTIONS, parallel=False, special_token_id=tok.special_token_id, start_after=marker)
    seq = engine.generate([prompt], SamplingParams(max_tokens=150, temperature=0.0, constraint=c))[0]
    out = seq.output_token_ids
    cut = free.index(marker) + 1  # its first appearance ends the thinking
    assert out[:cut] == free[:cut]
    parsed = _calls(fmt, tok.decode(out[cut:]))
    assert len(parsed.tool_calls) == 1 and seq.status == SeqStatus.FINISHED_STOPPED
