"""The mocker models speculative decoding (issue 34): ``--mock-spec-acceptance`` sets how many
tokens a drafting row emits per step, through the real scheduler; ``mesh top`` shows the
acceptance and tokens per step a worker reports."""

from __future__ import annotations

import pytest

from cli.main import build_parser
from cli.top import spec_columns
from engine.sampling import SamplingParams
from mesh.protocol import LoadReport
from mocker.engine import MockConfig, MockEngine
from worker.base import speculative_counters

PROMPTS = [[5 + i, 9, 11 + 2 * i, 3] * (2 + i) for i in range(6)]
N = 120


def run(**kw) -> tuple[MockEngine, list[list[int]]]:
    engine = MockEngine(MockConfig(speedup=1e9, num_blocks=256, **kw))
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    return engine, [s.output_token_ids for s in seqs]


def test_acceptance_sets_tokens_per_step_and_the_tokens_stay_the_mockers():
    plain, ref = run()
    assert plain.scheduler.drafter is None
    per_step = {}
    for alpha in (0.0, 0.5, 0.9, 1.0):
        engine, out = run(speculative="ngram", num_speculative_tokens=4, spec_acceptance=alpha)
        assert out == ref  # drafts only change how many steps the same tokens take
        c = engine.scheduler.spec
        assert engine.scheduler.drafter.name == "ngram"  # counted under the method it stands for
        per_step[alpha] = c.mean_accepted_length
        if alpha == 1.0:
            assert c.accepted == c.drafted and engine.num_steps < plain.num_steps / 3
        if alpha == 0.0:
            assert c.accepted == 0 and engine.num_steps >= plain.num_steps
    # K=4 at 0.9: (1 - 0.9^5) / 0.1 = 4.1 tokens per step at full length; adaptive K lowers it at 0.5,
    # a row's first step drafts one token, and max_tokens cuts its last draft
    assert per_step[0.0] == 1.0 < per_step[0.5] < per_step[0.9] < per_step[1.0]
    assert per_step[1.0] > 4.5
    assert 3.0 < per_step[0.9] <= 4.6


def test_verified_drafts_cost_step_time():
    plain = MockEngine(MockConfig(speedup=1e9, num_blocks=256))
    spec = MockEngine(MockConfig(speedup=1e9, num_blocks=256, speculative="ngram", spec_acceptance=0.0))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    plain.generate(PROMPTS[:1], params)
    spec.generate(PROMPTS[:1], params)
    # the same steps, one of them verifying a rejected draft
    assert spec.scheduler.spec.drafted == 1
    timing = spec.config.timing  # the draft, and its position's KV read
    assert spec.simulated_ms == pytest.approx(plain.simulated_ms + timing.decode_ms_per_draft_token
                                              + timing.decode_ms_per_kv_token)


def test_the_flags():
    args = build_parser().parse_args(["worker", "mock", "--speculative", "ngram", "--num-speculative-tokens", "3",
                                      "--mock-spec-acceptance", "0.4"])
    cfg = MockConfig.from_args(args)
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.spec_acceptance) == ("ngram", 3, 0.4)
    assert MockConfig.from_args(build_parser().parse_args(["worker", "mock"])).speculative is None
    with pytest.raises(ValueError, match="mock-spec-acceptance"):
        MockConfig(spec_acceptance=1.5)
    # mesh up --mock passes them on to its mock workers (python -m bench trace-replay: --mesh-arg)
    from cli.up import _worker_flags

    up = build_parser().parse_args(["up", "--mock", "--speculative", "ngram", "--mock-spec-acceptance", "0.5"])
    flags = _worker_flags(up)
    assert flags[flags.index("--speculative") + 1] == "ngram"
    assert flags[flags.index("--mock-spec-acceptance") + 1] == "0.5"


def test_mesh_top_shows_acceptance_and_tokens_per_step():
    engine, _ = run(speculative="ngram", num_speculative_tokens=4, spec_acceptance=1.0)
    report = LoadReport("w", "mock", "decode", 0.0, counters=speculative_counters(engine))
    c = engine.scheduler.spec
    assert spec_columns(report).split() == ["1.00", f"{c.emitted / c.steps:.2f}"] != ["1.00", "1.00"]
    assert spec_columns(LoadReport("w", "mock", "decode", 0.0)).split() == ["-", "-"]
