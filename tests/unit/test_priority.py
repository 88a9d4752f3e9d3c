"""Priority scheduling: interactive work goes first, preempts batch work, and everyone finishes
with the output they would have had alone."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus
from mocker.engine import MockConfig, MockEngine

LOW, HIGH = -1, 1


def solo(engine_factory, prompt, n):
    e = engine_factory()
    return e.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].output_token_ids


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


def test_higher_priority_is_admitted_first_and_pauses_lower(tiny):
    e = Engine(EngineConfig(tiny, num_kv_blocks=64, max_num_seqs=8))
    batch = [e.new_sequence([10 + i] * 20, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
             for i in range(4)]
    for s in batch:
        s.priority = LOW
        e.add(s)
    for _ in range(3):
        e.step()
    urgent = e.new_sequence([7, 8, 9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    urgent.priority = HIGH
    e.add(urgent)
    progress = [s.num_output_tokens for s in batch]
    steps = 0
    while not urgent.is_finished:
        e.step()
        steps += 1
    assert steps == 5  # one step per token: it never waited behind the batch
    assert [s.num_output_tokens for s in batch] == progress  # the batch paused meanwhile
    while any(not s.is_finished for s in batch):
        e.step()
    assert all(s.status == SeqStatus.FINISHED_LENGTH for s in batch)


def test_a_full_pool_preempts_batch_work_which_still_finishes_identically(tiny):
    def factory():
        return Engine(EngineConfig(tiny, num_kv_blocks=24, block_size=4))  # 96 tokens of KV

    e = factory()
    prompts = [[20 + i] * 20 for i in range(3)]
    batch = [e.new_sequence(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
    for s in batch:
        s.priority = LOW
        e.add(s)
    e.step()
    e.step()
    assert len(e.scheduler.running) == 3
    urgent_prompt = [5] * 60  # needs 16 blocks: only preemption can make room
    urgent = e.new_sequence(urgent_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    urgent.priority = HIGH
    e.add(urgent)
    e.step()
    assert urgent.status == SeqStatus.RUNNING and e.scheduler.num_preemptions >= 1
    while any(not s.is_finished for s in [*batch, urgent]):
        e.step()
    assert urgent.output_token_ids == solo(factory, urgent_prompt, 4)
    for s, p in zip(batch, prompts, strict=True):
        assert s.output_token_ids == solo(factory, p, 8)
    assert e.pool.num_used == 0


def test_the_mocker_honours_priority_too():
    e = MockEngine(MockConfig(speedup=10_000, num_blocks=64, max_num_seqs=2))
    low = [e.new_sequence([1, 2, 3], SamplingParams(max_tokens=50)) for _ in range(2)]
    for s in low:
        s.priority = LOW
        e.add(s)
    e.step()
    high = e.new_sequence([4, 5], SamplingParams(max_tokens=3))
    high.priority = HIGH
    e.add(high)
    e.step()
    assert high.status == SeqStatus.RUNNING  # max_num_seqs was full: a low one was preempted
    assert sum(s.status == SeqStatus.PREEMPTED for s in low) == 1
    while not high.is_finished:
        e.step()
    while any(not s.is_finished for s in low):
        e.step()
