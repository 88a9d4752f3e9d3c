"""Speculative decoding on rows that read each token as it is sampled: a grammar (JSON schema,
regex), penalties, logprobs, min_tokens. Each drafts (the counters say so) and, greedy, emits
exactly the tokens of decoding without speculation; logprobs are the same values."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.constraints import Constraint
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus
from engine.spec.oracle import OracleDrafter
from mesh.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4}},
          "required": ["name", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{3}( [a-c]{2,5}){1,3}"


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    from engine.config import EngineConfig
    from engine.engine import Engine

    made = []

    def make(**kw):
        cfg = dict(device="cpu", num_kv_blocks=256, max_num_batched_tokens=128, max_num_seqs=8, block_size=4)
        made.append(Engine(EngineConfig(tiny_model, **{**cfg, **kw})))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def chat(tok) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": f"Reply {i} in the format."}]) for i in range(3)]


def repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat themselves: prompt lookup has something to find."""
    return [[(37 * i + 11 * j) % 4000 + 8 for j in range(6)] * 3 for i in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **kw})


ROWS = {  # row kind -> (its params, whether its prompts are the chat ones)
    "json_schema": (greedy(max_tokens=60, ignore_eos=False, constraint=Constraint.json_schema(SCHEMA)), True),
    "regex": (greedy(max_tokens=40, ignore_eos=False, constraint=Constraint.regex(REGEX)), True),
    # penalties that favour repeats, so that prompt lookup finds drafts on the random model
    "repetition_penalty": (greedy(repetition_penalty=0.9), False),
    "presence_frequency": (greedy(presence_penalty=-0.5, frequency_penalty=0.3), False),
    "logprobs": (greedy(logprobs=3, presence_penalty=-0.5, frequency_penalty=0.3), False),  # raw, not penalized
}


def run(engine, ps, params):
    seqs = engine.generate(ps, [params] * len(ps))
    return [s.output_token_ids for s in seqs], seqs


def speculative(make_engine, drafter: str, ps, ref, alpha: float = 0.8, **kw):
    engine = make_engine(speculative="ngram", num_speculative_tokens=4, **kw)
    if drafter == "oracle":  # mostly right drafts: most are accepted
        engine.scheduler.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref, strict=True)}, alpha,
                                                 engine.vocab_size, seed=5)
    return engine


def check_valid(kind: str, tok, seqs) -> None:
    for s in seqs:
        text = tok.decode(s.output_token_ids)
        assert s.status == SeqStatus.FINISHED_STOPPED, (kind, s.status, text)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text, strict=False), SCHEMA)  # xgrammar lets control characters into strings
        else:
            assert re.fullmatch(REGEX, text), text


@pytest.fixture(scope="module")
def without_speculation(make_engine, chat):
    """Each row kind's outputs without speculation (``run``'s), made once for both drafters."""
    done = {}

    def outputs(kind: str):
        if kind not in done:
            params, chatty = ROWS[kind]
            done[kind] = run(make_engine(), chat if chatty else repetitive(3), params)
        return done[kind]

    return outputs


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
@pytest.mark.parametrize("kind", list(ROWS))
def test_each_row_kind_drafts_and_is_token_identical(make_engine, without_speculation, tok, chat, kind, drafter):
    params, chatty = ROWS[kind]
    ps = chat if chatty else repetitive(3)
    plain, plain_seqs = without_speculation(kind)
    engine = speculative(make_engine, drafter, ps, plain)
    out, seqs = run(engine, ps, params)
    assert out == plain
    c = engine.scheduler.spec
    assert c.drafted > 0
    if drafter == "oracle":
        assert c.accepted > 0 and engine.num_steps < sum(map(len, plain))  # accepted drafts saved steps
    if params.constraint is not None:
        check_valid(kind, tok, seqs)
    if params.logprobs is not None:
        for a, b in zip(plain_seqs, seqs, strict=True):
            assert len(b.output_logprobs) == len(b.output_token_ids)
            for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True):
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
                assert [t for t, _ in y.top] == [t for t, _ in x.top]
                assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)


def test_a_constrained_row_drafts_with_the_mask_thread(make_engine, tok, chat):
    """Masks filled in a thread of the engine (not the grammar process): the step's fill walks the
    same matchers as the drafted positions' masks, which wait for it."""
    import dataclasses

    from engine.constraints.manager import GrammarManager

    params, _ = ROWS["json_schema"]
    plain, _ = run(make_engine(), chat, params)
    engine = speculative(make_engine, "oracle", chat, plain)
    g = engine.grammar
    g.close()
    engine.grammar = engine.runner.grammar = GrammarManager(
        g.tokenizer_file, g.vocab_size, g.eos_token_ids, dataclasses.replace(g.config, process=False))
    out, seqs = run(engine, chat, params)
    assert out == plain and engine.grammar.process_pid is None
    assert engine.scheduler.spec.accepted > 0
    check_valid("json_schema", tok, seqs)


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_xgrammar_checks_and_masks_drafts_too(make_engine, tok, chat, kind):
    """The other backend (its matcher's rollback; masks filled in a thread: it has no process)."""
    pytest.importorskip("xgrammar")
    params, _ = ROWS[kind]
    plain, _ = run(make_engine(grammar_backend="xgrammar"), chat, params)
    engine = speculative(make_engine, "oracle", chat, plain, grammar_backend="xgrammar")
    out, seqs = run(engine, chat, params)
    assert out == plain and engine.scheduler.spec.accepted > 0
    check_valid(kind, tok, seqs)


def test_seeded_sampled_rows_of_every_kind_reproduce_with_speculation(make_engine, tok, chat):
    """Sampled rows (a grammar, penalties, logprobs) draft and verify by rejection sampling; with a
    seed, a second run gives the same tokens, and the constrained output stays valid."""
    kinds = ["json_schema", "presence_frequency", "logprobs"]
    ps = [chat[0], *repetitive(2)]
    params = [SamplingParams(**{f: getattr(ROWS[k][0], f) for f in ("max_tokens", "constraint", "ignore_eos",
                                                                     "presence_penalty", "frequency_penalty",
                                                                     "logprobs")}, temperature=0.7, seed=i)
              for i, k in enumerate(kinds)]
    plain = [s.output_token_ids for s in make_engine().generate(ps, params)]
    runs = []
    for _ in range(2):
        engine = speculative(make_engine, "oracle", ps, plain)
        seqs = engine.generate(ps, params)
        runs.append([(s.output_token_ids, s.output_logprobs) for s in seqs])
        assert engine.scheduler.spec.accepted > 0
        check_valid("json_schema", tok, seqs[:1])
        assert len(seqs[2].output_logprobs) == len(seqs[2].output_token_ids)
    assert runs[0] == runs[1]


def test_a_grammar_that_starts_after_a_thinking_token_drafts_through_it(make_engine, tok, chat):
    """Free positions before the token that starts the grammar (drafts cut before it), masked ones
    after; the output is the one without speculation."""
    free, _ = run(make_engine(), chat[:1], greedy(max_tokens=8))
    marker = free[0][4]  # inside the first drafts
    params = greedy(max_tokens=60, ignore_eos=False, constraint=Constraint.json_schema(SCHEMA, start_after=marker))
    plain, _ = run(make_engine(), chat[:1], params)
    engine = speculative(make_engine, "oracle", chat[:1], plain, alpha=1.0)
    out, _ = run(engine, chat[:1], params)
    assert out == plain and engine.scheduler.spec.accepted > 0
    cut = out[0].index(marker) + 1
    jsonschema.validate(json.loads(tok.decode(out[0][cut:])), SCHEMA)


def test_min_tokens_holds_back_stops_at_every_drafted_position(make_engine):
    """The oracle drafts the stop token early (it ends the unconstrained reference there): below
    min_tokens the target never takes it, so the draft is rejected and the output goes on."""
    ps = repetitive(3)
    free, _ = run(make_engine(), ps, greedy(max_tokens=30))
    stops = [r[3] for r in free]  # the 4th token: inside the first drafts
    params = [greedy(max_tokens=30, min_tokens=12, stop_token_ids=(s,)) for s in stops]
    plain = [s.output_token_ids for s in make_engine().generate(ps, params)]
    assert all(len(p) >= 12 for p in plain) and plain != [r[:len(p)] for r, p in zip(free, plain, strict=True)]
    # drafts that end the row at its stop token as the free run did (wrong below min_tokens)
    engine = speculative(make_engine, "oracle", ps, free, alpha=1.0)
    seqs = engine.generate(ps, params)
    assert [s.output_token_ids for s in seqs] == plain
    c = engine.scheduler.spec
    assert c.accepted > 0 and c.accepted < c.drafted  # the stop token drafted below min_tokens was rejected


def test_drafts_are_cut_where_the_grammar_refuses_and_the_matcher_rolls_back(make_engine, tok, chat):
    from engine.constraints.backend import bitmask_words

    engine = make_engine()
    grammar = engine.grammar
    seq = engine.new_sequence(chat[0], greedy(constraint=Constraint.regex(REGEX)))
    grammar.attach(seq)
    state = seq.grammar
    yes, comma = tok.encode("yes", False), tok.encode(", 1", False)
    good = [*yes, *comma]
    assert state.draft_prefix([*good, *yes]) == len(good)  # "yes, 1yes": the last refused
    assert state.draft_prefix(tok.encode("maybe", False)) == 0
    bitmask, positions = grammar.draft_masks([(None, [5, 6]), (state, good)])
    assert positions == list(range(3, 3 + len(good) + 1))  # the free row has none
    # each position's mask is the one of a matcher that took the drafts before it
    for j in range(len(good) + 1):
        fresh = grammar.backend.matcher(grammar.cache.get(seq.params.constraint))
        assert all(fresh.consume(t) for t in good[:j])
        want = torch.empty((1, bitmask_words(engine.vocab_size)), dtype=torch.int32)
        grammar.backend.fill([(fresh, 0)], want)
        assert torch.equal(bitmask[j], want[0]), j
    # and the state's matcher is where it was: the whole draft again, then "no" refused after "yes"
    assert state.draft_prefix(good) == len(good)
    assert state.advance(yes[0]) and not state.error
