"""Constrained decoding in the engine, with the tiny random-weight model: only the grammar can make
its output valid. Every schema of the corpus (tests/data/json_schemas.json) must come out as JSON
that validates, greedy and seeded, under preemption, with prefix hits, and after a rebuild from the
tokens generated so far."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.constraints import Constraint, ConstraintError
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SampledToken, SeqStatus
from mesh.errors import RequestError
from mesh.tokenizer import Tokenizer

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=1024))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": "Reply with JSON that fits the schema."}])


def _params(schema, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **kw},
                          constraint=Constraint.json_schema(schema))


def validate(text: str, schema: dict) -> object:
    """Parse and validate, numbers as decimals (``163.33`` is a multiple of ``0.01``; not in floats)."""
    value = json.loads(text, parse_float=Decimal)
    jsonschema.validate(value, json.loads(json.dumps(schema), parse_float=Decimal))
    return value


def _check_valid(tok, seqs, corpus=CORPUS) -> None:
    for entry, seq in zip(corpus, seqs, strict=True):
        text = tok.decode(seq.output_token_ids)
        assert seq.status == SeqStatus.FINISHED_STOPPED, (entry["name"], seq.status, text)
        validate(text, entry["schema"])


@pytest.fixture(scope="module")
def greedy(engine, prompt):
    return engine.generate([prompt] * len(CORPUS), [_params(e["schema"]) for e in CORPUS])


def test_the_corpus_is_large_and_varied():
    assert len(CORPUS) >= 50
    text = json.dumps(CORPUS)
    for feature in ('"enum"', '"anyOf"', '"pattern"', '"maxLength"', '"minimum"', '"exclusiveMinimum"',
                    '"items"', '"$ref"', '"number"', '"null"', '"const"'):
        assert feature in text, feature


def test_every_schema_of_the_corpus_validates_greedy(tok, greedy):
    _check_valid(tok, greedy)
    # the grammar, not the model, ended every output: the tiny model never emits EOS by itself here
    assert all(s.output_token_ids[-1] not in (0, 2) for s in greedy)


def test_without_the_grammar_the_tiny_model_does_not_write_json(engine, prompt, tok):
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tok.decode(free.output_token_ids))


def test_every_schema_validates_seeded_and_the_seed_reproduces_the_output(engine, prompt, tok):
    params = [_params(e["schema"], temperature=1.0, top_p=0.95, seed=1000 + i) for i, e in enumerate(CORPUS)]
    seqs = engine.generate([prompt] * len(CORPUS), params)
    _check_valid(tok, seqs)
    # the same seeds alone, in another batch and order: the same tokens
    picks = [3, 17, 29, 41, 55]
    again = engine.generate([prompt] * len(picks), [params[i] for i in reversed(picks)])
    assert [s.output_token_ids for s in reversed(again)] == [seqs[i].output_token_ids for i in picks]
    other = engine.generate([prompt], _params(CORPUS[picks[0]]["schema"], temperature=1.0, seed=1))[0]
    assert other.output_token_ids != seqs[picks[0]].output_token_ids


def test_preemption_under_a_small_pool_gives_the_same_valid_outputs(tiny_model, prompt, tok, greedy):
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=12, block_size=8))
    try:
        picks = list(range(0, len(CORPUS), 4))
        seqs = eng.generate([prompt] * len(picks), [_params(CORPUS[i]["schema"]) for i in picks])
        assert eng.scheduler.num_preemptions > 0
        assert [s.output_token_ids for s in seqs] == [greedy[i].output_token_ids for i in picks]
        _check_valid(tok, seqs, [CORPUS[i] for i in picks])
        assert eng.pool.num_used == 0
    finally:
        eng.close()


def test_a_prefix_hit_gives_the_same_valid_output(engine, tok, greedy):
    long_prompt = tok.encode_chat([{"role": "system", "content": "You answer with JSON only. " * 6},
                                   {"role": "user", "content": "Reply with JSON that fits the schema."}])
    entry = CORPUS[9]
    (first,) = engine.generate([long_prompt], _params(entry["schema"]))
    (second,) = engine.generate([long_prompt], _params(entry["schema"]))
    assert second.num_cached_tokens >= 32
    assert second.output_token_ids == first.output_token_ids
    _check_valid(tok, [second], [entry])


@pytest.mark.parametrize("index, sampling", [(30, {"temperature": 0.0}), (58, {"temperature": 0.8, "seed": 5})])
def test_a_rebuilt_request_continues_exactly_as_the_uninterrupted_run(engine, prompt, index, sampling):
    """Migration: a new sequence of prompt + the first k tokens (output_offset k) rebuilds its matcher
    from those tokens and continues token for token; all of them: it ends (stop) with none more."""
    schema = CORPUS[index]["schema"]
    (whole,) = engine.generate([prompt], _params(schema, **sampling))
    out = whole.output_token_ids
    for k in (1, len(out) - 2, len(out)):  # the last: the stream was cut after its last token
        resumed = engine.new_sequence(prompt + out[:k], _params(schema, max_tokens=MAX_TOKENS - k, **sampling))
        resumed.output_offset = k
        engine.add(resumed)
        assert resumed.grammar is not None and resumed.grammar.num_tokens == k
        while not resumed.is_finished:
            engine.step()
        assert resumed.output_token_ids == out[k:], k
        assert resumed.status == SeqStatus.FINISHED_STOPPED


def test_tokens_that_break_the_grammar_cannot_be_resumed(engine, prompt, tok):
    seq = engine.new_sequence(prompt + tok.encode("hello", add_special_tokens=False),
                              _params(CORPUS[0]["schema"]))
    seq.output_offset = 1
    with pytest.raises(ConstraintError, match="do not match"):
        engine.add(seq)


def test_the_first_token_of_a_remote_prefill_advances_the_grammar(engine, prompt, tok):
    """Disaggregated: the decode side reserves the blocks (and attaches the grammar); the prefill
    worker's first token goes through the grammar like any other; one it rejects ends the request."""
    schema = CORPUS[0]["schema"]
    open_brace = tok.encode("{", add_special_tokens=False)[0]
    seq = engine.new_sequence(prompt, _params(schema), request_id="remote-ok")
    assert engine.reserve_remote(seq) and seq.grammar is not None
    out = engine.complete_remote("remote-ok", SampledToken(open_brace))
    assert out.finish_reason is None and seq.grammar.num_tokens == 1
    engine.abort("remote-ok")
    bad = engine.new_sequence(prompt, _params(schema), request_id="remote-bad")
    assert engine.reserve_remote(bad)
    out = engine.complete_remote("remote-bad", SampledToken(tok.encode("x", add_special_tokens=False)[0]))
    assert out.finish_reason == "error" and bad.grammar.error
    assert engine.pool.num_used == 0


def test_constrained_and_free_rows_share_a_batch(engine, prompt, greedy):
    free = SamplingParams(max_tokens=10, temperature=0.0)
    (alone,) = engine.generate([prompt], free)
    mixed = engine.generate([prompt] * 3, [free, _params(CORPUS[9]["schema"]), free])
    assert mixed[0].output_token_ids == mixed[2].output_token_ids == alone.output_token_ids
    assert mixed[1].output_token_ids == greedy[9].output_token_ids


def test_the_grammar_starts_after_the_end_of_thinking_token(engine, prompt, tok):
    """A reasoning model thinks freely; the schema applies from the token after ``start_after``."""
    free = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].output_token_ids
    marker = free[3]
    c = Constraint.json_schema(CORPUS[20]["schema"], start_after=marker)
    seq = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, constraint=c))[0]
    out = seq.output_token_ids
    cut = out.index(marker) + 1
    assert out[:cut] == free[:cut]  # nothing was masked before the marker
    validate(tok.decode(out[cut:]), CORPUS[20]["schema"])
    assert seq.status == SeqStatus.FINISHED_STOPPED


@pytest.mark.parametrize("constraint, pattern", [
    (Constraint.regex(r"(yes|no), [0-9]{3}"), r"(yes|no), [0-9]{3}"),
    (Constraint.lark('start: "answer: " NUM\nNUM: /[1-9][0-9]{0,2}/'), r"answer: [1-9][0-9]{0,2}"),
])
def test_regex_and_lark_constraints(engine, prompt, tok, constraint, pattern):
    seq = engine.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0, constraint=constraint))[0]
    text = tok.decode(seq.output_token_ids)
    assert seq.status == SeqStatus.FINISHED_STOPPED and re.fullmatch(pattern, text), text


def test_json_object_output_is_an_object_until_max_tokens_cuts_it(engine, prompt, tok):
    """Any JSON object: the random model never closes its first key, so the output is cut by
    ``max_tokens``; what it wrote is the start of a JSON object (closing it makes one)."""
    seq = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0,
                                                   constraint=Constraint.json_object()))[0]
    text = tok.decode(seq.output_token_ids)
    assert seq.status == SeqStatus.FINISHED_LENGTH and text.startswith("{")
    assert isinstance(_close_json(text), dict), text


def _close_json(prefix: str) -> object:
    """The JSON value ``prefix`` (cut anywhere) starts, closed the shortest way that parses."""
    stack, in_str, esc = [], False, False
    for ch in prefix:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            stack.pop()
    closers = "".join(reversed(stack))
    for quote in (['n"' if esc else '"'] if in_str else [""]):
        for fix in ("", ": 0", "0", '"k": 0', "ue", "e", "rue", "alse", "lse", "se", "ull", "ll", "l"):
            try:
                return json.loads(prefix + quote + fix + closers)
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"not the start of a JSON value: {prefix!r}")


def test_max_tokens_cuts_a_constrained_output_with_length(engine, prompt, tok):
    seq = engine.generate([prompt], _params(CORPUS[6]["schema"], max_tokens=5))[0]
    assert seq.status == SeqStatus.FINISHED_LENGTH and seq.num_output_tokens == 5


def test_logprobs_of_constrained_tokens_are_the_models(engine, prompt):
    seq = engine.generate([prompt], _params(CORPUS[1]["schema"], logprobs=2))[0]
    assert len(seq.output_logprobs) == seq.num_output_tokens
    assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in seq.output_logprobs)


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "strng"}}}, "invalid json_schema"),
    ({"type": "string", "pattern": "(unclosed"}, "invalid json_schema"),
    ({"type": "object", "properties": {"a": {"type": "string", "x-unknown-but-fine": 1}},
      "unevaluatedItems": False, "dependentSchemas": {"a": {}}}, "invalid json_schema"),
])
def test_invalid_schemas_are_request_errors_and_the_failure_is_cached(engine, prompt, schema, message):
    before = engine.grammar.cache.stats.misses
    for _ in range(2):
        with pytest.raises(ConstraintError, match=message):
            engine.add(engine.new_sequence(prompt, _params(schema)))
    assert engine.grammar.cache.stats.misses == before + 1  # the second time was a cache hit


def test_compiled_grammars_are_cached_with_counters(engine, prompt, greedy):
    stats = engine.grammar.stats()
    assert stats["compile_misses"] >= len(CORPUS) and stats["compile_hits"] > 0
    assert stats["mask_steps"] > 0 and stats["mask_rows"] >= stats["mask_steps"]
    hits = engine.grammar.cache.stats.hits
    engine.grammar.prepare(Constraint.json_schema(CORPUS[0]["schema"]))
    assert engine.grammar.cache.stats.hits == hits + 1


def test_the_mocker_refuses_constraints_it_cannot_enforce():
    from mocker.engine import MockConfig, MockEngine

    eng = MockEngine(MockConfig(speedup=1000, num_blocks=64))
    seq = eng.new_sequence([1, 2, 3], _params({"type": "integer"}))
    with pytest.raises(RequestError, match="does not enforce constraints"):
        eng.add(seq)


def test_bad_constraints_are_refused_when_built():
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        Constraint("yaml", "a: 1")
    with pytest.raises(ConstraintError, match="needs a source"):
        Constraint.regex("")


def test_overlapped_scheduling_gives_the_same_constrained_outputs(tiny_model, prompt, tok, greedy):
    """A constrained row's mask follows its previous token: with overlap on, the engine resolves the
    step in flight before filling it, so outputs equal the blocking loop's (free rows still overlap)."""
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=1024, async_scheduling=True))
    try:
        picks = [0, 9, 17]
        free = SamplingParams(max_tokens=10, temperature=0.0)
        out = eng.generate([prompt] * 4, [_params(CORPUS[i]["schema"]) for i in picks] + [free])
    finally:
        eng.close()
    assert eng.overlap is not None
    assert [s.output_token_ids for s in out[:3]] == [greedy[i].output_token_ids for i in picks]
    _check_valid(tok, out[:3], [CORPUS[i] for i in picks])



def test_the_grammar_process_ends_rows_as_the_engines_own_matchers_would(engine, tiny_model, prompt, greedy):
    """With the grammar process (the default) a replica's verdict ends a complete row one step after
    its last token, without that step's token: the tokens and finish reasons are those of an engine
    that checks every token itself (the mask thread), for complete rows and rows cut by max_tokens."""
    import dataclasses

    from engine.constraints.manager import GrammarManager

    picks = list(range(0, len(CORPUS), 6))
    short = [SamplingParams(max_tokens=7, temperature=0.0, constraint=Constraint.json_object()),
             SamplingParams(max_tokens=9, temperature=0.0, constraint=Constraint.regex("a"))]
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=1024))
    try:
        g = eng.grammar
        g.close()
        eng.grammar = eng.runner.grammar = GrammarManager(
            g.tokenizer_file, g.vocab_size, g.eos_token_ids, dataclasses.replace(g.config, process=False))
        threaded = eng.generate([prompt] * (len(picks) + 2), [_params(CORPUS[i]["schema"]) for i in picks] + short)
        assert eng.grammar.process_pid is None
    finally:
        eng.close()
    processed = [greedy[i] for i in picks] + engine.generate([prompt] * 2, short)
    assert engine.grammar.process_pid is not None
    assert [s.output_token_ids for s in processed] == [s.output_token_ids for s in threaded]
    assert [s.status for s in processed] == [s.status for s in threaded]
    assert threaded[-2].status == SeqStatus.FINISHED_LENGTH and threaded[-1].status == SeqStatus.FINISHED_STOPPED
    assert len(processed[-1].output_token_ids) == 1  # "a": complete after one token, nothing more taken
