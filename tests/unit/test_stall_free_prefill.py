"""Stall-free batching (``max_prefill_with_decode``): a burst of admissions never takes more than
the cap of prompt tokens in a step that also decodes, so every running stream still gets its
token each step and no step grows by a whole burst of prefills; with nothing decoding, a prompt
takes the whole budget; outputs are the same with and without the cap."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mocker.engine import MockConfig, MockEngine, TimingModel

CAP = 96
DEAR_PREFILL = TimingModel(prefill_ms_per_token=0.5)  # 16 prompt tokens cost a decode step: the flag's cap binds


def mock(cap: int) -> MockEngine:
    return MockEngine(MockConfig(speedup=1e6, num_blocks=4096, max_num_batched_tokens=2048,
                                 max_prefill_with_decode=cap, timing=DEAR_PREFILL))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_tokens(out) -> int:
    return sum(c.num_tokens for c in out.chunks if not c.seq.output_token_ids)


def test_a_burst_of_prompts_takes_at_most_the_cap_per_decoding_step():
    e = mock(CAP)
    streams = [e.new_sequence([5 + i] * 40, greedy(200)) for i in range(4)]
    for s in streams:
        e.add(s)
    e.step()  # nothing decodes yet: all four prompts (160 tokens) in one step, past the cap
    assert all(len(s.output_token_ids) == 1 for s in streams)
    burst = [e.new_sequence([100 + i] * 50, greedy(4)) for i in range(20)]  # 1000 prompt tokens
    for s in burst:
        e.add(s)
    steps = 0
    while any(not s.output_token_ids for s in burst):
        out = e.scheduler.schedule()
        assert 0 < prompt_tokens(out) <= CAP
        decoding = {id(c.seq) for c in out.chunks if c.seq in streams}
        assert decoding == {id(s) for s in streams}  # every stream advances every step
        e.scheduler.update(out, e.execute(out))
        steps += 1
    assert steps >= 1000 // CAP  # the burst was spread over steps, a partial prompt carried over
    assert all(len(s.output_token_ids) == 1 + steps for s in streams)


def test_without_decodes_a_long_prompt_takes_the_whole_budget():
    e = mock(CAP)
    s = e.new_sequence([7] * 1500, greedy(2))
    e.add(s)
    out = e.scheduler.schedule()
    assert prompt_tokens(out) == 1500


def test_without_the_cap_a_burst_takes_the_whole_budget():
    e = mock(0)
    streams = [e.new_sequence([5 + i] * 40, greedy(50)) for i in range(4)]
    for s in streams:
        e.add(s)
    e.step()
    for i in range(20):
        e.add(e.new_sequence([100 + i] * 50, greedy(4)))
    assert prompt_tokens(e.scheduler.schedule()) == 1000


def test_outputs_are_the_same_with_and_without_the_cap(tiny_model):
    prompts = [[11 + i] * (30 + 7 * i) for i in range(6)]

    def run(cap: int) -> list[list[int]]:
        e = Engine(EngineConfig(tiny_model, num_kv_blocks=256, max_prefill_with_decode=cap))
        first = [e.new_sequence(p, greedy(12)) for p in prompts[:2]]
        for s in first:
            e.add(s)
        e.step()  # these two decode while the rest are admitted under the cap
        rest = [e.new_sequence(p, greedy(12)) for p in prompts[2:]]
        for s in rest:
            e.add(s)
        while any(not s.is_finished for s in first + rest):
            e.step()
        return [s.output_token_ids for s in first + rest]

    assert run(16) == run(0)


def test_the_mockers_cap_is_never_below_a_decode_steps_worth_of_prompt_tokens():
    """The mocker knows what a prompt token costs: where prefill is cheap against a step (side_by_side's
    matched steps) a burst is not spread over steps for nothing; where it is dear the flag stands."""
    cheap = TimingModel(decode_base_ms=20.0, prefill_ms_per_token=0.001)
    assert MockConfig(max_prefill_with_decode=512, timing=cheap).prefill_cap == 20_000
    assert MockConfig(max_prefill_with_decode=512).prefill_cap == 512  # the reference: 133 tokens a step
    assert MockConfig(max_prefill_with_decode=0, timing=cheap).prefill_cap == 0  # no cap stays none
    assert MockConfig(max_prefill_with_decode=512, timing=TimingModel(prefill_ms_per_token=0.0)).prefill_cap == 0
    e = MockEngine(MockConfig(speedup=1e6, num_blocks=8192, max_num_batched_tokens=8192,
                              max_prefill_with_decode=512, timing=cheap))
    streams = [e.new_sequence([5 + i] * 40, greedy(50)) for i in range(4)]
    for s in streams:
        e.add(s)
    e.step()
    burst = [e.new_sequence([100 + i] * 115, greedy(4)) for i in range(60)]  # 6,900 prompt tokens
    for s in burst:
        e.add(s)
    e.step()  # all of them in the next step, beside the decodes
    assert all(len(s.output_token_ids) == 1 for s in burst)
