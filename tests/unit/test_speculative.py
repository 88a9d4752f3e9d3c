"""Speculative decoding (issue 34): drafters propose, one forward pass verifies, greedy rows
accept the longest matching prefix, and the output is token-identical to decoding without it.

The real engine on the tiny model (CPU): ``ngram`` and the benchmark's ``oracle`` drafter (the
target's own continuation, partly corrupted), in batches mixing drafting and non-drafting rows,
with ``max_tokens`` and stop tokens landing inside a draft, prefix-cache hits and preemption.
"""

from __future__ import annotations

import random

import pytest

from engine.sampling import SamplingParams
from engine.spec.ngram import lookup
from engine.spec.oracle import OracleDrafter
from engine.spec.registry import SpecConfig, create_drafter
from engine.spec.verify import accept_greedy


def test_ngram_lookup_takes_the_latest_longest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(toks, 2, 3, 1) == [7, 8]  # "1 2 3" last seen before the suffix at index 4
    assert lookup([4, 5, 6], 3, 3, 1) == []  # nothing repeats
    assert lookup([5, 6, 5], 2, 3, 1) == [6, 5]  # falls back to a 1-gram


def test_greedy_verification_accepts_the_matching_prefix_and_the_token_after():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus a bonus
    assert accept_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # second rejected: the target's correction
    assert accept_greedy([1], [2, 3]) == [2]


def test_an_unknown_method_or_k_is_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num-speculative-tokens"):
        SpecConfig("ngram", 0)
    assert create_drafter("ngram:2").max_n == 2


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    from engine.config import EngineConfig
    from engine.engine import Engine

    def make(**kw):
        cfg = dict(device="cpu", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, block_size=4)
        return Engine(EngineConfig(tiny_model, **{**cfg, **kw}))

    return make


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(8, 4096) for _ in range(5 + i)]
        out.append(base * 3)  # repeats: prompt lookup has something to find
    return out


def outputs(engine, ps, params) -> list[list[int]]:
    return [s.output_token_ids for s in engine.generate(ps, params)]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy rows that draft, one greedy row that opts out, a sampled one that opts out (seeded:
    with speculation it would draw other tokens from the same distribution), one with penalties."""
    out = [greedy(9 + 3 * i, ignore_eos=True) for i in range(n)]
    out[1] = greedy(11, ignore_eos=True, speculate=False)
    out[2] = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, speculate=False)
    out[3] = greedy(12, ignore_eos=True, repetition_penalty=1.2)
    return out


def test_ngram_is_token_identical_in_a_mixed_batch(make_engine):
    ps, params = prompts(6), mixed_params(6)
    plain = outputs(make_engine(), ps, params)
    spec = make_engine(speculative="ngram", num_speculative_tokens=3)
    assert outputs(spec, ps, params) == plain
    assert spec.scheduler.spec.drafted > 0  # it did speculate


def oracle_engine(make_engine, ps, ref, alpha, **kw):
    engine = make_engine(speculative="ngram", **kw)
    engine.scheduler.drafter = OracleDrafter({tuple(p): r for p, r in zip(ps, ref, strict=True)}, alpha,
                                             engine.vocab_size, seed=3)
    return engine


@pytest.mark.parametrize("alpha", [1.0, 0.6, 0.0])
def test_oracle_drafts_are_token_identical_and_max_tokens_cut_inside_a_draft(make_engine, alpha):
    ps = prompts(5, seed=2)
    ref = outputs(make_engine(), ps, greedy(40, ignore_eos=True))
    # max_tokens 1 + 4 + 2: the second step's draft of 4 runs past it
    params = [greedy(m, ignore_eos=True) for m in (7, 10, 13, 3, 40)]
    want = [r[:p.max_tokens] for r, p in zip(ref, params, strict=True)]
    engine = oracle_engine(make_engine, ps, ref, alpha, num_speculative_tokens=4)
    assert outputs(engine, ps, params) == want
    c = engine.scheduler.spec
    assert c.drafted > 0
    if alpha == 1.0:
        assert c.accepted == c.drafted and c.mean_accepted_length > 3  # every draft accepted
        assert engine.num_steps < sum(p.max_tokens for p in params) / 2
    if alpha == 0.0:
        assert c.accepted == 0 and c.emitted == c.steps
    assert engine.pool.num_free == engine.pool.num_blocks  # every block came back (rolled-back ones too)


def test_a_stop_token_inside_a_draft_ends_the_output_there(make_engine):
    ps = prompts(3, seed=4)
    ref = outputs(make_engine(), ps, greedy(30, ignore_eos=True))
    stops = [r[5] for r in ref]  # the 6th token: inside the second step's draft (1 + 4 + ...)
    params = [greedy(30, ignore_eos=True, stop_token_ids=(s,)) for s in stops]
    want = [r[: r.index(s) + 1] for r, s in zip(ref, stops, strict=True)]
    engine = oracle_engine(make_engine, ps, ref, 1.0, num_speculative_tokens=4)
    seqs = engine.generate(ps, params)
    assert [s.output_token_ids for s in seqs] == want
    assert all(s.status.finish_reason == "stop" for s in seqs)


def test_prefix_hit_then_speculation_and_hashes_cover_only_accepted_tokens(make_engine):
    ps = prompts(2, seed=5)
    ref = outputs(make_engine(), ps, greedy(24, ignore_eos=True))
    engine = oracle_engine(make_engine, ps, ref, 0.5, num_speculative_tokens=4)
    assert outputs(engine, ps, greedy(24, ignore_eos=True)) == ref
    again = engine.generate(ps, greedy(24, ignore_eos=True))
    assert [s.output_token_ids for s in again] == ref
    assert all(s.num_cached_tokens > 0 for s in again)
    # every cached block is named by the hash of real tokens: a fresh sequence of the same
    # tokens (prompt + output) finds all its full blocks but the last
    for s in again:
        probe = engine.new_sequence(s.token_ids, greedy(1))
        assert len(engine.kv_manager.match_prefix(probe)) == (len(s.token_ids) - 1) // engine.block_size


def test_speculation_under_preemption_is_token_identical(make_engine):
    ps = prompts(6, seed=6)
    params = greedy(30, ignore_eos=True)
    ref = outputs(make_engine(), ps, params)
    engine = oracle_engine(make_engine, ps, ref, 0.7, num_speculative_tokens=4, num_kv_blocks=30)
    assert outputs(engine, ps, params) == ref
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec.accepted > 0


# -- sampled rows: rejection sampling preserves the target's distribution ---------------------

CHI2_CRITICAL_0001 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,  # df 1..10
                      31.26, 32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31,  # 11..20
                      46.80, 48.27, 49.73, 51.18, 52.62, 54.05]  # 21..26
TOP_K = 3


def target_pairs(model_dir, prompt: list[int], temperature: float) -> dict[tuple[int, int], float]:
    """P(first two tokens) under temperature and top-k, from Hugging Face transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0, -1] / temperature
        vals, idx = x.topk(TOP_K)
        return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist(), strict=True))

    return {(a, b): pa * pb for a, pa in dist(prompt).items() for b, pb in dist(prompt + [a]).items()}


def chi_square(counts: dict, expected: dict[tuple[int, int], float], n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected under 5 are pooled, as is
    anything outside the support."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, n - sum(counts.get(c, 0) for c in expected), 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    else:
        assert pooled_obs == 0, "tokens outside the top-k support were drawn"
    return stat, df


class FixedDrafter:
    """Drafts ``tokens`` for the second output token on, whatever came before: accepted with their
    probability after one first token, never after the others (outside their top-k)."""

    name = "fixed"

    def __init__(self, *tokens: int):
        self.tokens = list(tokens)

    def propose(self, seq, k: int) -> list[int]:
        return self.tokens[:k] if len(seq.output_token_ids) == 1 else []


class StartAtK:
    """Every new row drafts K (``engine.spec.adaptive.AcceptancePrior``'s interface)."""

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def start(self, max_k: int, batch: int):
        from engine.spec.adaptive import DraftLength

        return DraftLength(max_k)


def test_rejection_sampling_preserves_the_distribution(make_engine, tiny_model):
    from collections import Counter

    prompt = random.Random(9).sample(range(8, 4096), 12)
    temperature, n = 2.0, 1200
    expected = target_pairs(tiny_model, prompt, temperature)
    # the draft: the second token whose probability after its first one is nearest 1/2
    first = Counter()
    for (a, _), p in expected.items():
        first[a] += p
    draft = min(expected, key=lambda c: abs(expected[c] / first[c[0]] - 0.5))[1]
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=TOP_K, seed=s, ignore_eos=True)
              for s in range(n)]
    results = {}
    for spec in (False, True):
        engine = make_engine(max_num_seqs=256, num_kv_blocks=1400, max_num_batched_tokens=4096,
                             speculative="ngram" if spec else None, num_speculative_tokens=2)
        if spec:
            engine.scheduler.drafter = FixedDrafter(draft)
            engine.scheduler.spec_prior = StartAtK()  # every row drafts (adaptive K would stop most at batch 256)
        outs = outputs(engine, [prompt] * n, params)
        stat, df = chi_square(Counter((o[0], o[1]) for o in outs), expected, n)
        assert stat < CHI2_CRITICAL_0001[df - 1], (spec, stat, df)
        results[spec] = outs
        c = engine.scheduler.spec
        if spec:  # the draft was both accepted and rejected
            assert 0 < c.accepted < c.drafted
            again = outputs(engine, [prompt] * 40, params[:40])
            assert again == outs[:40]  # seeded: reproducible with speculation too
    assert results[True] != results[False]  # speculation drew its own samples (same distribution)


def target_triples(model_dir, prompt: list[int], temperature: float, presence: float,
                   frequency: float) -> dict[tuple[int, int, int], float]:
    """P(first three tokens) under presence and frequency penalties (counting the tokens before
    each), then temperature and top-k, from Hugging Face transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()

    def dist(generated):
        with torch.no_grad():
            x = model(torch.tensor([prompt + generated])).logits[0, -1]
        for t in set(generated):
            x[t] -= frequency * generated.count(t) + presence
        vals, idx = (x / temperature).topk(TOP_K)
        return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist(), strict=True))

    return {(a, b, c): pa * pb * pc for a, pa in dist([]).items() for b, pb in dist([a]).items()
            for c, pc in dist([a, b]).items()}


def test_rejection_sampling_with_penalties_preserves_the_distribution(make_engine, tiny_model):
    """Two drafts after the first token: the first three tokens follow the penalized target (a row
    whose drafting positions ignored penalties fails it), and seeds reproduce them. That a drafted
    position's penalties count the drafts before it is checked exactly by the greedy rows of
    test_spec_rows (the same processed logits): the effect on these frequencies is too small to see."""
    from collections import Counter

    # a prompt whose continuations the penalties change (the random model's top tokens are far
    # apart: mostly they change nothing); here they favour repeats
    prompt = random.Random(8).sample(range(8, 4096), 12)
    temperature, n, presence, frequency = 2.0, 800, -1.5, -1.0
    expected = target_triples(tiny_model, prompt, temperature, presence, frequency)
    free = target_triples(tiny_model, prompt, temperature, 0.0, 0.0)
    assert sum(abs(expected.get(c, 0) - free.get(c, 0)) for c in {*expected, *free}) / 2 > 0.25
    pairs = Counter()
    for (a, b, _), p in expected.items():
        pairs[a, b] += p
    # the first draft: the second token most likely repeated third, where the drafted position's
    # penalties count that draft most
    a, d1 = max(pairs, key=lambda c: expected.get((*c, c[1]), 0.0))
    d2 = max((c for c in expected if c[:2] == (a, d1)), key=expected.get)[2]
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=TOP_K, seed=s, ignore_eos=True,
                             presence_penalty=presence, frequency_penalty=frequency) for s in range(n)]
    for spec in (False, True):
        engine = make_engine(max_num_seqs=256, num_kv_blocks=1400, max_num_batched_tokens=4096,
                             speculative="ngram" if spec else None, num_speculative_tokens=2)
        if spec:
            engine.scheduler.drafter = FixedDrafter(d1, d2)
            engine.scheduler.spec_prior = StartAtK()
        outs = outputs(engine, [prompt] * n, params)
        stat, df = chi_square(Counter(tuple(o[:3]) for o in outs), expected, n)
        assert stat < CHI2_CRITICAL_0001[df - 1], (spec, stat, df)
        if spec:
            c = engine.scheduler.spec
            assert 0 < c.accepted < c.drafted
            assert outputs(engine, [prompt] * 40, params[:40]) == outs[:40]  # seeded: reproducible


def test_draft_length_adapts_per_row():
    from engine.spec.adaptive import PROBE_EVERY, DraftLength

    d = DraftLength(4)
    assert d.next() == 4
    for want in (2, 1, 0):  # nothing accepted: halves down to 0
        d.update(d.k, 0, 4)
        assert d.k == want
    due = []
    for _ in range(PROBE_EVERY):
        due.append(d.due())
        assert d.next() == due[-1]  # due() foretells next() without counting a step
    assert due == [False] * (PROBE_EVERY - 1) + [True]  # a probe
    d.update(1, 0, 4)  # rejected: the next probe comes twice as late
    assert [d.next() for _ in range(2 * PROBE_EVERY)].count(1) == 1 and d.idle == 0
    d.update(1, 1, 4)  # accepted: back to K
    assert d.k == 4 and d.next() == 4


def test_new_rows_start_from_the_methods_recent_acceptance():
    from engine.spec.adaptive import PROBE_EVERY, AcceptancePrior

    prior = AcceptancePrior()
    # nothing verified yet: K in a small batch, fewer drafts in a large one (each costs a position)
    assert [prior.start(4, batch).k for batch in (1, 4, 8, 16, 32)] == [4, 4, 2, 1, 0]
    assert prior.start(4, 32).probe_every == 8 * PROBE_EVERY  # a large batch probes less often
    for _ in range(40):
        prior.observe(4, 4)
    assert prior.start(4, 32).k == 4  # drafts accepted lately: K from the first step
    for _ in range(60):
        prior.observe(2, 0)
    assert prior.start(4, 1).k == 0 and not prior.start(4, 1).due()  # rejected lately: plain decode, probing


def test_rows_whose_drafts_are_always_rejected_stop_drafting(make_engine):
    ps = prompts(3, seed=8)
    ref = outputs(make_engine(), ps, greedy(60, ignore_eos=True))
    engine = oracle_engine(make_engine, ps, ref, 0.0, num_speculative_tokens=4)
    assert outputs(engine, ps, greedy(60, ignore_eos=True)) == ref
    c = engine.scheduler.spec
    # per row: 4 + 2 + 1 drafts (a small batch), then one-token probes after 16 and 32 more steps
    assert 0 < c.drafted <= 3 * (4 + 2 + 1 + 2)
    drafted = c.drafted
    assert outputs(engine, ps, greedy(15, ignore_eos=True)) == [r[:15] for r in ref]
    assert c.drafted == drafted  # new rows after rejected drafts start as plain rows (no probe yet)


def test_with_fixed_k_rows_draft_k_every_step_however_often_rejected(make_engine):
    """``--no-speculative-adaptive``: every decoding step of every row verifies K drafts (fewer only
    where ``max_tokens`` leaves less room), all rejected here, and each rolled back."""
    ps = prompts(3, seed=8)
    ref = outputs(make_engine(), ps, greedy(60, ignore_eos=True))
    engine = oracle_engine(make_engine, ps, ref, 0.0, num_speculative_tokens=4, spec_adaptive=False)
    assert outputs(engine, ps, greedy(60, ignore_eos=True)) == ref
    c = engine.scheduler.spec
    # a row's decoding steps after its first token, with 1..58 tokens out: 4 drafts each, 3 + 2 + 1 at the end
    assert (c.drafted, c.accepted, c.steps) == (3 * (55 * 4 + 3 + 2 + 1), 0, 3 * 58)


def test_the_worker_reports_speculation_per_method(make_engine):
    from mesh.metrics import LoadCollector
    from mesh.protocol import LoadReport
    from worker.base import speculative_counters

    ps = prompts(2, seed=10)
    ref = outputs(make_engine(), ps, greedy(20, ignore_eos=True))
    engine = oracle_engine(make_engine, ps, ref, 1.0, num_speculative_tokens=4)
    engine.generate(ps, greedy(20, ignore_eos=True))
    assert speculative_counters(make_engine()) == {}  # no drafter: nothing reported
    counters = speculative_counters(engine)
    c = engine.scheduler.spec
    assert counters == {"spec_drafted:oracle": c.drafted, "spec_accepted:oracle": c.accepted,
                        "spec_emitted:oracle": c.emitted, "spec_rows:oracle": c.steps}
    report = LoadReport(worker_id="w", model="tiny", role="decode", timestamp=0.0, counters=counters)
    got = {(m.name, tuple(s.labels.get(k, "") for k in ("method", "kind"))): s.value
           for m in LoadCollector(lambda: report).collect() for s in m.samples}
    assert got[("pdmesh_spec_tokens", ("oracle", "drafted"))] == c.drafted > 0
    assert got[("pdmesh_spec_tokens", ("oracle", "emitted"))] == c.emitted
    assert got[("pdmesh_spec_acceptance_rate", ("oracle", ""))] == 1.0
    assert got[("pdmesh_spec_mean_accepted_length", ("oracle", ""))] == pytest.approx(c.emitted / c.steps)


def test_mesh_generate_and_the_workers_take_the_flags(tiny_model, capsys):
    import argparse
    import json

    from cli.main import build_parser, main
    from cli.up import _worker_flags
    from engine import flags

    def generate(*extra):
        assert main(["generate", "--model", str(tiny_model), "--json", "--max-tokens", "24", "--ignore-eos",
                     *extra, "one two three one two three one two"]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert generate("--speculative", "ngram", "--num-speculative-tokens", "3") == generate()
    assert main(["generate", "--model", str(tiny_model), "--speculative", "eagle9", "x"]) != 0
    assert "unknown speculative method 'eagle9'" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    flags.add_args(p)
    args = p.parse_args(["--model", str(tiny_model), "--speculative", "ngram:2", "--num-speculative-tokens", "5"])
    config = flags.from_args(args)
    assert (config.speculative, config.num_speculative_tokens) == ("ngram:2", 5)
    up = build_parser().parse_args(["up", "--speculative", "ngram:2", "--num-speculative-tokens", "5"])
    worker = _worker_flags(up)
    assert worker[worker.index("--speculative") + 1] == "ngram:2"
    assert worker[worker.index("--num-speculative-tokens") + 1] == "5"
    assert "--no-speculative-adaptive" not in worker and config.spec_adaptive
    fixed = flags.from_args(p.parse_args(["--model", str(tiny_model), "--speculative", "ngram", "--no-speculative-adaptive"]))
    assert not fixed.spec_adaptive
    assert "--no-speculative-adaptive" in _worker_flags(build_parser().parse_args(
        ["up", "--speculative", "ngram", "--no-speculative-adaptive"]))


def test_verification_rows_logits_match_transformers(make_engine, tiny_model):
    """Rows of several query tokens batch with the decode rows in the torch attention (padded to the
    longest): every position's logits are transformers' on the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    ps = prompts(3, seed=11)
    ref = outputs(make_engine(), ps, greedy(14, ignore_eos=True))
    engine = oracle_engine(make_engine, ps, ref, 1.0, num_speculative_tokens=4)
    params = [greedy(m, ignore_eos=True) for m in (14, 9, 12)]
    seqs = [engine.new_sequence(p, sp) for p, sp in zip(ps, params, strict=True)]
    for s in seqs:
        engine.add(s)
    engine.runner.capture_logits = True
    schedule, steps = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        steps.append(out)
        return out

    engine.scheduler.schedule = spy
    seen = []  # (sequence, first position, logits of its rows)
    while any(not s.is_finished for s in seqs):
        engine.step()
        out, row = steps[-1], 0
        for c in out.chunks:
            if c.drafts:
                seen.append((c.seq, c.start, engine.runner.last_logits[row:row + c.num_tokens].clone()))
            row += c.num_tokens
    assert [s.output_token_ids for s in seqs] == [r[:p.max_tokens] for r, p in zip(ref, params, strict=True)]
    assert len({len(x) for _, _, x in seen}) > 1  # rows of different lengths were verified
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    with torch.no_grad():
        full = {id(s): hf(torch.tensor([s.token_ids])).logits[0] for s in seqs}
    for seq, start, logits in seen:
        torch.testing.assert_close(logits, full[id(seq)][start:start + len(logits)], atol=2e-3, rtol=1e-3)


def test_speculation_with_overlapped_scheduling_is_token_identical(make_engine):
    """Rows that may draft run their steps without overlap (the drafter reads their last token)."""
    ps, params = prompts(5, seed=12), mixed_params(5)
    plain = outputs(make_engine(), ps, params)
    engine = make_engine(speculative="ngram", num_speculative_tokens=3, async_scheduling=True)
    assert engine.overlap is not None
    assert outputs(engine, ps, params) == plain
    assert engine.scheduler.spec.drafted > 0
