"""Overlapped scheduling gives the tokens the plain loop gives.

Two layers:

* ``ScriptedEngine``: the real scheduler, block pool and prefix cache over a model whose n-th
  token of a request is a fixed function of (prompt, n), EOS included. No torch: fast enough to
  run many mixes of finishes (EOS, stop ids, max_tokens, context length), preemption, chunked
  prefill, prefix hits, priorities and aborts landing while a step is in flight.
* the real engine on the tiny model (torch backend, CPU): the same, through the runner, where a
  row's input token is taken from the previous step's samples on the device.

In every case: each request's tokens (and logprobs) equal the plain loop's, outputs come in
order, nothing is emitted for a request after its abort, and every block comes back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.core import CoreConfig, EngineCore
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import SampledToken, Sequence

VOCAB = 1000
EOS = 7


class ScriptedEngine(EngineCore):
    """Token ``n`` of a request is ``f(prompt, n)``; EOS comes where ``eos_at`` says."""

    def __init__(self, async_scheduling: bool, num_blocks: int = 64, budget: int = 64, max_len: int = 4096,
                 eos_at: dict[tuple[int, ...], int] | None = None):
        super().__init__(CoreConfig(model_name="scripted", vocab_size=VOCAB, block_size=4, num_blocks=num_blocks,
                                    max_model_len=max_len, max_num_seqs=8, max_num_batched_tokens=budget,
                                    eos_token_ids=(EOS,), async_scheduling=async_scheduling))
        self.eos_at = eos_at or {}
        self.launched = 0

    def token(self, seq: Sequence, index: int) -> int:
        key = tuple(seq.prompt_token_ids)
        if self.eos_at.get(key) == index:
            return EOS
        t = (hash(key) * 31 + index * 1009) % VOCAB
        return t + 1 if t == EOS else t

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        self.launched += 1
        # the index of the token being sampled: tokens known, plus those still in flight
        return [SampledToken(self.token(c.seq, c.seq.num_output_tokens_scheduled)) for c in out.sampling_chunks]


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    add_at: int = 0  # the step before which it arrives
    abort_at: int | None = None  # the step before which it is cancelled


def run(engine: EngineCore, requests: list[Request], max_steps: int = 2000) -> dict[str, tuple[list[int], str | None]]:
    """Drive the engine as a worker does (commands between steps); each request's emitted tokens
    and finish reason. Fails on an output after an abort or after a finish."""
    emitted: dict[str, list[int]] = {r.rid: [] for r in requests}
    finish: dict[str, str | None] = {r.rid: None for r in requests}
    aborted: set[str] = set()
    for step in range(max_steps):
        for r in requests:
            if r.add_at == step:
                seq = engine.new_sequence(r.prompt, r.params, request_id=r.rid)
                seq.priority = r.priority
                engine.add(seq)
            if r.abort_at == step and finish[r.rid] is None:
                engine.abort(r.rid)
                aborted.add(r.rid)
        pending = any(r.add_at > step for r in requests)
        if not engine.has_work and not pending:
            break
        if not engine.has_work:
            continue
        for o in engine.step():
            assert o.request_id not in aborted, f"{o.request_id}: output after its abort"
            assert finish[o.request_id] is None, f"{o.request_id}: output after its finish"
            emitted[o.request_id] += o.new_token_ids
            assert o.num_output_tokens == len(emitted[o.request_id]), "outputs out of order"
            finish[o.request_id] = o.finish_reason
    else:
        raise AssertionError("the engine did not finish")
    assert engine.pool.num_used == 0, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return {rid: (emitted[rid], "abort" if rid in aborted and finish[rid] is None else finish[rid]) for rid in emitted}


def assert_same_tokens(plain, overlapped, requests):
    for r in requests:
        (p_toks, p_fin), (o_toks, o_fin) = plain[r.rid], overlapped[r.rid]
        if r.abort_at is None:
            assert (o_toks, o_fin) == (p_toks, p_fin), r.rid
        else:  # cancelled mid-run: whatever came out is the start of what the uncancelled run gives
            assert o_toks == p_toks[: len(o_toks)], r.rid


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def scripted_mix(seed: int) -> tuple[list[Request], dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, VOCAB) for _ in range(12)]
    requests, eos_at = [], {}
    for i in range(10):
        own = [rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = (shared if rng.random() < 0.5 else []) + own  # half share a cached prefix
        stop = ()
        if rng.random() < 0.3:
            eos_at[tuple(prompt)] = rng.randint(0, 12)
        params = greedy(rng.randint(1, 20), stop_token_ids=stop, ignore_eos=rng.random() < 0.1)
        requests.append(Request(f"r{i}", prompt, params, priority=rng.choice([0, 0, 0, -1]),
                                add_at=rng.randint(0, 15), abort_at=None))
    # stop ids: a token the request would produce, so it stops there
    probe = ScriptedEngine(False)
    for r in requests[:3]:
        seq = probe.new_sequence(r.prompt, r.params)
        r.params = greedy(r.params.max_tokens, stop_token_ids=(probe.token(seq, 2),))
    return requests, eos_at


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_scripted_overlap_matches_the_plain_loop(seed, pool):
    requests, eos_at = scripted_mix(seed)
    kw = dict(num_blocks=64 if pool == "roomy" else 14, budget=24, eos_at=eos_at)
    plain = run(ScriptedEngine(False, **kw), requests)
    overlapped = ScriptedEngine(True, **kw)
    got = run(overlapped, requests)
    assert_same_tokens(plain, got, requests)


def test_the_tight_pool_mixes_do_preempt_with_overlap():
    preempted = 0
    for seed in range(12):
        requests, eos_at = scripted_mix(seed)
        engine = ScriptedEngine(True, num_blocks=14, budget=24, eos_at=eos_at)
        run(engine, requests)
        preempted += engine.scheduler.num_preemptions > 0
    assert preempted >= 6


@pytest.mark.parametrize("seed", range(6))
def test_scripted_aborts_landing_mid_overlap(seed):
    requests, eos_at = scripted_mix(seed)
    reference = run(ScriptedEngine(False, eos_at=eos_at, budget=24), requests)
    rng = random.Random(100 + seed)
    for r in requests:
        if rng.random() < 0.5:
            r.abort_at = r.add_at + rng.randint(0, 8)  # while prefilling, decoding, or after finishing
    for async_scheduling in (False, True):
        engine = ScriptedEngine(async_scheduling, num_blocks=20, eos_at=eos_at, budget=24)
        assert_same_tokens(reference, run(engine, requests), requests)


def test_context_limit_and_max_tokens_stop_without_an_extra_step():
    # prompt 10 in a 14-token context: 4 tokens by length; max_tokens 3 stops first for the other
    requests = [Request("ctx", list(range(20, 30)), greedy(100)), Request("max", list(range(40, 45)), greedy(3))]
    plain = ScriptedEngine(False, max_len=14)
    overlapped = ScriptedEngine(True, max_len=14)
    a, b = run(plain, requests), run(overlapped, requests)
    assert a == b and a["ctx"][1] == "length" and len(a["ctx"][0]) == 4 and len(a["max"][0]) == 3
    # no step is launched for a token that is known to be the last: one step per token
    assert overlapped.launched == plain.launched


def test_a_request_stopping_on_eos_costs_one_dropped_row_not_a_token():
    prompt = [11, 12, 13]
    requests = [Request("eos", prompt, greedy(50))]
    plain, overlapped = ScriptedEngine(False, eos_at={tuple(prompt): 4}), ScriptedEngine(True, eos_at={tuple(prompt): 4})
    a, b = run(plain, requests), run(overlapped, requests)
    assert a == b and a["eos"][1] == "stop" and len(a["eos"][0]) == 5 and a["eos"][0][-1] == EOS
    assert overlapped.launched == plain.launched + 1  # the step after EOS ran before EOS was known


# -- the real engine, tiny model, torch backend ----------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model):
    from engine.config import EngineConfig
    from engine.engine import Engine

    def make(async_scheduling: bool, **kw):
        cfg = dict(device="cpu", num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=6, block_size=4)
        return Engine(EngineConfig(tiny_model, async_scheduling=async_scheduling, **{**cfg, **kw}))

    return make


def engine_requests(stop_from: dict[str, list[int]] | None = None) -> list[Request]:
    rng = random.Random(5)
    shared = [rng.randrange(8, 4096) for _ in range(20)]
    specs = [  # (prompt, params)
        (shared + [9, 10, 11], greedy(12)),
        (shared + [12, 13], greedy(10, logprobs=3)),
        ([rng.randrange(8, 4096) for _ in range(60)], greedy(8)),  # chunked: budget 48
        ([rng.randrange(8, 4096) for _ in range(7)], SamplingParams(max_tokens=10, temperature=0.9, seed=3,
                                                                     top_k=50, top_p=0.9, logprobs=1)),
        ([rng.randrange(8, 4096) for _ in range(5)], greedy(9, repetition_penalty=1.3, presence_penalty=0.5)),
        (shared + [14], greedy(14)),
        ([rng.randrange(8, 4096) for _ in range(30)], SamplingParams(max_tokens=6, temperature=1.2, seed=11, min_p=0.05)),
        (shared[:8], greedy(7, ignore_eos=True)),
    ]
    reqs = [Request(f"e{i}", p, sp, add_at=(0 if i < 5 else 3 + i)) for i, (p, sp) in enumerate(specs)]
    if stop_from:  # a stop id each for two requests: a token they produce at index 3
        for r in reqs[:2]:
            toks = stop_from[r.rid][0]
            r.params = SamplingParams(**{**_fields(r.params), "stop_token_ids": (toks[3],)})
    return reqs


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_engine_overlap_is_token_identical_with_stops_preemption_chunks_and_prefix_hits(engines):
    first = run(engines(False), engine_requests())
    requests = engine_requests(stop_from=first)
    plain_engine, overlap_engine = engines(False, num_kv_blocks=24), engines(True, num_kv_blocks=24)
    seqs: dict[str, dict[str, Sequence]] = {}
    for name, engine in (("plain", plain_engine), ("overlap", overlap_engine)):
        added = {}
        original = engine.add

        def add(seq, added=added, original=original):
            added[seq.request_id] = seq
            original(seq)

        engine.add = add
        seqs[name] = added
        result = run(engine, requests)
        if name == "plain":
            plain = result
        else:
            overlapped = result
    assert_same_tokens(plain, overlapped, requests)
    assert [plain[r.rid][1] for r in requests[:2]] == ["stop", "stop"]
    for rid in plain:  # logprobs too (the sampler's copies of them came with the tokens)
        a, b = seqs["plain"][rid].output_logprobs, seqs["overlap"][rid].output_logprobs
        assert len(a) == len(b), rid
        for x, y in zip(a, b, strict=True):  # up to rounding: a batch of other rows may sum in another order
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert overlap_engine.scheduler.num_preemptions > 0  # 24 blocks of 4 tokens: requests were preempted
    assert any(s.num_cached_tokens > 0 for s in seqs["overlap"].values())  # prefix hits
    assert overlap_engine.overlap is not None and plain_engine.overlap is None


def test_engine_aborts_landing_mid_overlap(engines):
    requests = engine_requests()
    reference = run(engines(False), requests)
    for i, r in enumerate(requests):
        if i % 2 == 0:
            r.abort_at = r.add_at + 2 + i % 3
    got = run(engines(True, num_kv_blocks=24), requests)
    assert_same_tokens(reference, got, requests)
    assert any(got[r.rid][1] == "abort" and got[r.rid][0] for r in requests if r.abort_at is not None)


def test_engine_generate_with_overlap_matches_without(engines):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], list(range(100, 140))]
    a = engines(False).generate(prompts, greedy(6))
    e = engines(True)
    b = e.generate(prompts, greedy(6))
    assert [s.output_token_ids for s in a] == [s.output_token_ids for s in b]
    assert not e.has_work and e.pool.num_used == 0
