"""Sampling: seeds, stops, lengths, logprobs, penalties, truncation."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus, Sequence


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model, num_kv_blocks=512))


PROMPTS = [[11, 12, 13, 14, 15], [400, 401, 402], list(range(100, 140))]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine.generate([PROMPTS[0]], p)[0].output_token_ids
    batched = engine.generate(PROMPTS, [p, SamplingParams(max_tokens=5, temperature=1.0), p])
    assert batched[0].output_token_ids == alone
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=99))
    assert other_seed[0].output_token_ids != alone


def test_stop_token_ends_with_stop_and_max_tokens_with_length(engine):
    greedy = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert greedy.status == SeqStatus.FINISHED_LENGTH and greedy.num_output_tokens == 12
    stop_at = greedy.output_token_ids[4]
    first = greedy.output_token_ids.index(stop_at)
    stopped = engine.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.status == SeqStatus.FINISHED_STOPPED
    assert stopped.output_token_ids == greedy.output_token_ids[: first + 1]


def test_eos_stops_unless_ignored(tiny_model):
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=64))
    greedy = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    eng.scheduler.config = type(eng.scheduler.config)(
        **{**eng.scheduler.config.__dict__, "eos_token_ids": (greedy.output_token_ids[2],)}
    )
    s = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert s.status == SeqStatus.FINISHED_STOPPED and s.num_output_tokens <= 3
    s = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert s.output_token_ids == greedy.output_token_ids


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_model):
    """Before ``min_tokens``, EOS and stop ids are neither drawn nor an end (vLLM's rule); after it
    they stop the output as usual."""
    eng = Engine(EngineConfig(tiny_model, num_kv_blocks=64))
    greedy = eng.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0))[0].output_token_ids
    stop_at = greedy[0]  # the first greedy token: without min_tokens the output is just it
    p = dict(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    assert eng.generate([PROMPTS[2]], SamplingParams(**p))[0].output_token_ids == [stop_at]
    held = eng.generate([PROMPTS[2]] * 2, [SamplingParams(**p, min_tokens=4),
                                       SamplingParams(**{**p, "temperature": 1.0, "seed": 7}, min_tokens=12)])
    assert stop_at not in held[0].output_token_ids[:4] and held[0].num_output_tokens >= 4
    assert held[0].status == SeqStatus.FINISHED_STOPPED or held[0].num_output_tokens == 12
    assert stop_at not in held[1].output_token_ids and held[1].status == SeqStatus.FINISHED_LENGTH
    eng.scheduler.config = type(eng.scheduler.config)(**{**eng.scheduler.config.__dict__, "eos_token_ids": (stop_at,)})
    eng.sampler.eos_token_ids = (stop_at,)
    (eos,) = eng.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5))
    assert stop_at not in eos.output_token_ids[:5] and eos.num_output_tokens >= 5


def test_logprobs_are_consistent_with_the_tokens(engine):
    s = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]
    assert len(s.output_logprobs) == 8
    for tok, lp in zip(s.output_token_ids, s.output_logprobs, strict=True):
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0.0


def _seq(tokens, **kw):
    return Sequence("x", list(tokens), SamplingParams(**kw), block_size=16, hash_seed=0)


def test_top_k_one_and_tiny_top_p_are_greedy():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(4, 50)
    seqs = [_seq([1], temperature=1.0, top_k=1), _seq([1], temperature=5.0, top_p=1e-6),
            _seq([1], temperature=1.0, min_p=1.0), _seq([1], temperature=0.0)]
    out = sampler(logits, seqs)
    assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()


def test_penalties_change_the_choice():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    s = _seq([3], temperature=0.0, repetition_penalty=2.0)  # token 3 seen in the prompt
    assert sampler(logits.clone(), [s])[0].token_id == 4
    s = _seq([1], temperature=0.0, frequency_penalty=0.5)
    s.output_token_ids.append(3)
    assert sampler(logits.clone(), [s])[0].token_id == 4
    s = _seq([1], temperature=0.0, presence_penalty=-1.0)
    s.output_token_ids.append(4)
    assert sampler(logits.clone(), [s])[0].token_id == 4
    assert sampler(logits.clone(), [_seq([3], temperature=0.0)])[0].token_id == 3


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2),
    dict(min_p=1.5), dict(logprobs=21), dict(presence_penalty=3), dict(repetition_penalty=0),
    dict(max_tokens=4, min_tokens=5), dict(min_tokens=-1),
])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_vanishing_temperature_is_greedy_not_a_crash(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    tiny = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=1e-300))[0]
    assert tiny.output_token_ids == greedy.output_token_ids


def test_a_resumed_request_continues_exactly(engine):
    """Migration: prompt + the tokens generated so far, with their count as the output offset,
    continues token for token (seeded sampling and penalties included)."""
    params = dict(max_tokens=16, temperature=0.9, top_k=50, seed=7, frequency_penalty=0.5, presence_penalty=0.3)
    whole = engine.generate([PROMPTS[2]], SamplingParams(**params))[0].output_token_ids
    k = 6
    resumed = engine.new_sequence(PROMPTS[2] + whole[:k], SamplingParams(**{**params, "max_tokens": 16 - k}))
    resumed.output_offset = k
    engine.add(resumed)
    while not resumed.is_finished:
        engine.step()
    assert resumed.output_token_ids == whole[k:]


def test_extreme_penalties_and_temperatures_do_not_break_sampling():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(3, 50) * 10
    seqs = [_seq([1, 2, 3], temperature=2.0, repetition_penalty=1e-300),
            _seq([4, 5], temperature=1.1e-5, top_p=0.5, frequency_penalty=2.0),
            _seq([6], temperature=1.0, repetition_penalty=10.0, min_p=1.0)]
    seqs[1].output_token_ids.extend([4, 4, 4])
    out = sampler(logits.clone(), seqs)
    assert all(0 <= o.token_id < 50 for o in out)
