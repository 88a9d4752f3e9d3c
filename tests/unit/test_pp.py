"""Pipeline parallelism in one process tree: engines of ``--pp 2``, ``--pp 3`` (over 5 layers:
stages of 1, 2 and 2) and ``--tp 2 --pp 2`` (rank 0 here, the other ranks helper processes,
gloo between them) against the single-rank engine, on a dense and a MoE model: greedy tokens
identical with chunked prefill, prefix-cache hits, preemption, a JSON schema and n-gram
speculation, micro-batching on and off; the KV of each stage under the same block ids; and
every layout refused in one line."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.constraints import Constraint
from engine.engine import Engine
from engine.parallel.group import ParallelGroupError
from engine.parallel.layout import Layout, even_split
from engine.sampling import SamplingParams
from engine.spec.adaptive import AcceptancePrior
from engine.tiny import write_tiny_model
from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, copy_blocks
from kvstore.transfer import Refused, TransferTarget
from kvstore.transfer.shm import ShmReceiver, ShmSender, shm_path
from mesh.tokenizer import Tokenizer
from tests.helpers.procs import alive
from tests.helpers.references import prompts_of, run_with_logits

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
KW = dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)
LAYOUTS = {"pp2": dict(pp=2), "pp3": dict(pp=3), "tp2pp2": dict(tp=2, pp=2)}
PROMPTS = prompts_of([3, 17, 40, 100, 9, 150], 4096, seed=1, low=3)  # the 150-token one takes 3 chunks


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny dense model and the tiny MoE (``--size moe``), with 5 layers each: 3 stages do
    not split them evenly."""
    root = tmp_path_factory.mktemp("pp-models")
    return {kind: write_tiny_model(root / kind, size=size, num_hidden_layers=5)
            for kind, size in (("dense", "tiny"), ("moe", "moe"))}


class Engines:
    """Engines built once per module, closed at its end; every rank process must be gone then."""

    def __init__(self):
        self.built: dict[tuple, Engine] = {}

    def get(self, path: Path, **kw) -> Engine:
        key = (str(path), *sorted(kw.items()))
        if key not in self.built:
            self.built[key] = Engine(EngineConfig(path, **{**KW, **kw}))
        return self.built[key]

    def close(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        pids = [p for e in self.built.values() if e.ranks for p in e.ranks.pids]
        with ThreadPoolExecutor(len(self.built)) as pool:  # each waits for its ranks to exit
            list(pool.map(Engine.close, self.built.values()))
        assert_gone(pids)


def assert_gone(pids, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), "a rank outlived its engine"


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(models, engines) -> dict[str, tuple]:
    """Per model, the single rank's tokens, cached tokens and logits of ``PROMPTS``."""
    return {kind: run_with_logits(engines.get(path), PROMPTS, GREEDY) for kind, path in models.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_layout_is_token_identical_to_one_rank_with_chunks_and_a_prefix_hit(models, engines, reference, kind, layout):
    one = engines.get(models[kind])
    many = engines.get(models[kind], **LAYOUTS[layout])
    assert many.layout == Layout.for_model(many.layout.tp, many.layout.pp, 5)
    out, cached, logits = run_with_logits(many, PROMPTS, GREEDY)
    want_out, want_cached, want_logits = reference[kind]
    assert out == want_out and cached == want_cached
    assert len(logits) == len(want_logits)
    for a, b in zip(want_logits, logits, strict=True):  # every row, brought back from the last stage
        assert (a - b).abs().max().item() < 1e-4
    # a prompt sharing the 150-token prompt's first 120 tokens: its full blocks hit on every stage
    shared = [*PROMPTS[5][:120], 5, 6, 7]
    out1, cached1, _ = run_with_logits(one, [shared], GREEDY)
    out2, cached2, _ = run_with_logits(many, [shared], GREEDY)
    assert cached2 == cached1 == [120]
    assert out2 == out1
    assert many.pool.num_used == 0
    stats = many.stage_stats()
    assert [s.stage for s in stats] == [r // many.layout.tp for r in range(many.layout.size)]
    assert all(s.steps == stats[0].steps > 0 and s.busy_s > 0 for s in stats)


def test_each_stage_holds_its_layers_kv_under_the_same_block_ids(models, engines):
    """tp 2 x pp 2 over 5 layers: rank r holds layers 0-1 (stage 0) or 2-4 (stage 1), one KV head
    of two; rank 0 sees them as one pool, whose bytes are the single rank's."""
    one = engines.get(models["dense"])
    many = engines.get(models["dense"], **LAYOUTS["tp2pp2"])
    kv = many.kv_cache
    assert isinstance(kv, ShardedKVCache) and kv.spec == one.kv_cache.spec
    assert [(p.layers, p.heads) for p in kv.parts()] == [((0, 2), (0, 1)), ((0, 2), (1, 2)),
                                                           ((2, 5), (0, 1)), ((2, 5), (1, 2))]
    prompt = prompts_of([50], 4096, seed=9, low=3)[0]
    blocks = []
    for e in (one, many):
        seq = e.new_sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        seq.hold_blocks = True  # as a prefill worker does: the blocks stay ours until release
        e.add(seq)
        while not seq.is_finished:
            e.step()
        blocks.append(list(seq.block_table))
        e.release(seq.request_id)
    a, b = one.kv_cache.read_blocks(blocks[0]), kv.read_blocks(blocks[1])
    assert a.shape[0] == 5 and a.abs().max() > 0
    assert (a - b).abs().max().item() < 1e-4


# speculation off: ``run_with_logits`` compares the logits of every step with the single rank's
NGRAM = dict(speculative="ngram", num_speculative_tokens=3)


def test_micro_batching_on_and_off_give_the_same_tokens(models, engines, reference):
    """A step of 8 rows or more is cut into 2 micro-batches (one per stage) by default, into none
    with ``pp_microbatches`` 1; prefill chunks are cut through their middle. (The engine without
    micro-batches also speculates: ``test_ngram_speculation_...``.)"""
    on = engines.get(models["dense"], pp=2, pp_steps_in_flight=1)  # one step at a time: each cut
    off = engines.get(models["dense"], pp=2, pp_microbatches=1, **NGRAM)
    on.stage_stats(reset=True)
    off.stage_stats(reset=True)
    prompts = prompts_of(range(10, 26), 4096, seed=4, low=3)  # 280 prompt tokens: 64-token chunks, then 16 rows
    want = [s.output_token_ids for s in engines.get(models["dense"]).generate(prompts, GREEDY)]
    assert [s.output_token_ids for s in on.generate(prompts, GREEDY)] == want
    assert [s.output_token_ids for s in off.generate(prompts, GREEDY)] == want
    on_stats, off_stats = on.stage_stats(), off.stage_stats()
    assert all(s.microbatches == s.steps for s in off_stats)
    # most steps have 8 rows or more (the last ones fewer: the sequences end a step apart)
    assert 1.5 * on_stats[0].steps < on_stats[0].microbatches <= 2 * on_stats[0].steps
    assert all((s.microbatches, s.steps) == (on_stats[0].microbatches, on_stats[0].steps) for s in on_stats)


def test_preemption_under_a_small_pool_is_token_identical(models, engines):
    prompts = prompts_of([40, 45, 50, 55], 4096, seed=5, low=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in engines.get(models["moe"]).generate(prompts, params)]
    # 4 x (7..10 blocks) do not fit at once (it speculates too: test_ngram_speculation_...)
    small = engines.get(models["moe"], pp=3, num_kv_blocks=24, **NGRAM)
    assert [s.output_token_ids for s in small.generate(prompts, params)] == want
    assert small.scheduler.num_preemptions > 0
    assert small.pool.num_used == 0


def test_a_json_schema_is_enforced_and_token_identical(models, engines):
    schemas = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())[:3]
    tok = Tokenizer(models["dense"])
    prompt = tok.encode_chat([{"role": "user", "content": "Reply with JSON that fits the schema."}])
    params = [SamplingParams(max_tokens=120, temperature=0.0, constraint=Constraint.json_schema(s["schema"]))
              for s in schemas]
    want = [s.output_token_ids for s in engines.get(models["dense"]).generate([prompt] * 3, params)]
    seqs = engines.get(models["dense"], **LAYOUTS["tp2pp2"]).generate([prompt] * 3, params)
    assert [s.output_token_ids for s in seqs] == want
    for s in seqs:
        json.loads(tok.decode(s.output_token_ids))


@pytest.mark.parametrize(("kind", "layout"), [("dense", dict(pp=2, pp_microbatches=1)),
                                              ("moe", dict(pp=3, num_kv_blocks=24))])
def test_ngram_speculation_is_verified_through_the_stages(models, engines, kind, layout):
    """The drafted rows' hidden states come back from the last stage with the sampled rows'."""
    prompts = [p * 3 for p in prompts_of([6, 9, 12, 7], 4000, seed=5, low=3)]  # repeats for lookup to find
    want = [s.output_token_ids for s in engines.get(models[kind]).generate(prompts, GREEDY)]
    spec = engines.get(models[kind], **layout, **NGRAM)
    spec.scheduler.spec_prior = AcceptancePrior()  # forget earlier tests' acceptance (random prompts: none)
    drafted, accepted = spec.scheduler.spec.drafted, spec.scheduler.spec.accepted
    assert [s.output_token_ids for s in spec.generate(prompts, GREEDY)] == want
    assert spec.scheduler.spec.drafted > drafted and spec.scheduler.spec.accepted > accepted


# -- steps in flight (engine.inflight): the default over several stages ----------------------

def in_flight(engine: Engine) -> Engine:
    """One of the module's engines with steps in flight (the default over several stages), their
    counters reset, and its logits no longer kept (``run_with_logits``: every step then runs whole)."""
    engine.runner.capture_logits = False
    engine.pipeline.most_in_flight = engine.steps_in_flight.whole = 0
    return engine


def mixed_requests(one: Engine) -> tuple[list[list[int]], list[SamplingParams]]:
    """11 prompts (one of 3 chunks) with outputs of different lengths: one ends on a stop token
    mid-run (a token the single rank gives it), one has penalties."""
    prompts = prompts_of([3, 17, 40, 150, 9, 25, 6, 12, 30, 8, 20], 4096, seed=6, low=3)
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.0, repetition_penalty=1.3)
    probe = one.generate([prompts[2]], params[2])[0].output_token_ids
    params[2] = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(probe[3],))
    return prompts, params


@pytest.mark.parametrize(("kind", "layout"), [("dense", "pp2"), ("moe", "pp3"), ("dense", "tp2pp2")])
def test_steps_in_flight_are_token_identical_with_uneven_groups_stops_and_a_prefix_hit(models, engines, kind, layout):
    one = engines.get(models[kind])
    many = in_flight(engines.get(models[kind], **LAYOUTS[layout]))
    prompts, params = mixed_requests(one)
    want = one.generate(prompts, params)
    got = many.generate(prompts, params)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    assert got[2].num_output_tokens < 30  # stopped mid-run
    # a step per stage was in flight at once, and none ran whole (the fallback)
    assert many.pipeline.most_in_flight == many.layout.pp and many.steps_in_flight.whole == 0
    shared = [*prompts[3][:120], 5, 6, 7]  # its first 15 blocks hit on every stage
    a, b = one.generate([shared, prompts[0]], GREEDY), many.generate([shared, prompts[0]], GREEDY)
    assert [s.output_token_ids for s in b] == [s.output_token_ids for s in a]
    assert b[0].num_cached_tokens == a[0].num_cached_tokens == 120
    assert many.pool.num_used == 0 and not many.has_work


def test_steps_in_flight_with_preemption_and_speculation_are_token_identical(models, engines):
    """A small pool preempts sequences whose step may be in flight; n-gram drafts are verified in
    flight."""
    prompts = [p * 3 for p in prompts_of([13, 15, 17, 14, 16, 18], 4000, seed=7, low=3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in engines.get(models["moe"]).generate(prompts, params)]
    small = in_flight(engines.get(models["moe"], pp=3, num_kv_blocks=24, **NGRAM))
    small.scheduler.spec_prior = AcceptancePrior()
    preempted, drafted = small.scheduler.num_preemptions, small.scheduler.spec.drafted
    assert [s.output_token_ids for s in small.generate(prompts, params)] == want
    assert small.scheduler.num_preemptions > preempted and small.scheduler.spec.drafted > drafted
    assert small.pipeline.most_in_flight >= 2 and small.steps_in_flight.whole == 0
    assert small.pool.num_used == 0


def test_a_sequence_preempted_in_flight_keeps_its_blocks_until_its_step_ran(models, engines, monkeypatch):
    """With the look-ahead that resolves the steps before a preemption switched off, victims are
    taken while their step is in flight: their blocks are held until it resolves (no writer outside
    the steps may have them before), and the tokens are still one rank's."""
    prompts = prompts_of([40, 45, 50, 55], 4096, seed=5, low=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in engines.get(models["dense"]).generate(prompts, params)]
    small = in_flight(engines.get(models["dense"], **LAYOUTS["pp2"], num_kv_blocks=24))
    flight = small.steps_in_flight
    monkeypatch.setattr(flight, "_may_preempt", lambda busy: False)
    held_in_flight = []

    def fence(seq):
        before = sum(len(f.held) for f in flight.steps)
        flight.fence(seq)
        held_in_flight.append(sum(len(f.held) for f in flight.steps) - before)

    monkeypatch.setattr(small.scheduler, "before_preempt", fence)
    assert [s.output_token_ids for s in small.generate(prompts, params)] == want
    assert any(held_in_flight), held_in_flight  # a victim's step was in flight: its blocks were held
    assert small.pool.num_used == 0 and not flight.steps


def test_an_aborted_sequence_s_blocks_wait_for_its_step_in_flight(models, engines):
    prompts = prompts_of([20, 21, 22, 23], 4096, seed=9, low=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in engines.get(models["dense"]).generate(prompts, params)]
    many = in_flight(engines.get(models["dense"], **LAYOUTS["pp2"]))
    seqs = [many.new_sequence(p, params) for p in prompts]
    for s in seqs:
        many.add(s)
    steps = many.steps_in_flight.steps

    def flying(seq):
        return any(c.seq is seq for f in steps for c in f.out.chunks)

    while not (seqs[0].num_output_tokens >= 2 and flying(seqs[0])):
        many.step()
    free = many.pool.num_free
    many.abort(seqs[0].request_id)
    assert many.pool.num_free == free  # held while its step is in flight
    while flying(seqs[0]):
        many.step()
    assert many.pool.num_free > free
    while many.has_work:
        many.step()
    assert [s.output_token_ids for s in seqs[1:]] == want[1:] and many.pool.num_used == 0


def test_a_constrained_request_runs_whole_steps_beside_steps_in_flight(models, engines):
    """Steps with constrained rows run whole, one at a time; the others, in flight."""
    schema = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())[0]["schema"]
    tok = Tokenizer(models["dense"])
    prompt = tok.encode_chat([{"role": "user", "content": "Reply with JSON that fits the schema."}])
    plain = prompts_of([7, 9, 11, 13], 4096, seed=8, low=3)
    many = in_flight(engines.get(models["dense"], **LAYOUTS["pp2"]))
    many.generate(plain, GREEDY)  # the plain ones alone: in flight; with the constrained one: whole
    assert many.steps_in_flight.whole == 0 and many.pipeline.most_in_flight == 2
    params = [SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint.json_schema(schema)),
              *[GREEDY] * len(plain)]
    want = [s.output_token_ids for s in engines.get(models["dense"]).generate([prompt, *plain], params)]
    seqs = many.generate([prompt, *plain], params)
    assert [s.output_token_ids for s in seqs] == want
    assert many.steps_in_flight.whole > 0
    json.loads(tok.decode(seqs[0].output_token_ids))


def test_a_dead_stage_fails_the_step_and_every_later_one(models):
    engine = Engine(EngineConfig(models["dense"], num_kv_blocks=64, pp=2))
    pids = engine.ranks.pids
    try:
        assert engine.generate([[5, 6, 7]], GREEDY)[0].num_output_tokens == 10
        os.kill(pids[0], signal.SIGKILL)
        assert_gone(pids)
        with pytest.raises(RuntimeError):
            engine.generate([[5, 6, 7, 8]], GREEDY)
        with pytest.raises(ParallelGroupError, match="closed"):
            engine.generate([[9, 10]], GREEDY)
    finally:
        engine.close()


# -- layouts refused in one line -------------------------------------------------------

def test_layouts_split_evenly_or_as_told_and_number_ranks_stage_major():
    assert even_split(5, 3) == (1, 2, 2) and even_split(10, 2) == (5, 5) and even_split(4, 4) == (1, 1, 1, 1)
    layout = Layout.for_model(2, 2, 5, (3, 2))
    assert [layout.layers(s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [layout.place(r).stage for r in range(4)] == [0, 0, 1, 1]
    assert (layout.next_rank(1), layout.prev_rank(3), layout.next_rank(2), layout.returning_rank) == (3, 1, None, 2)
    assert layout.stage_ranks(1) == (2, 3)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(pp=6), "--pp 6 is more stages than the model's 5 layers"),
    (dict(pp=2, pp_layers=(1, 2)), "--pp-layers 1,2 sums to 3, the model has 5 layers"),
])
def test_layouts_that_do_not_fit_the_model_are_refused(models, kw, message):
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(models["dense"], **kw))


@pytest.mark.parametrize(("kw", "refused"), [
    (dict(loras=(("a", "/x"),)), "--lora"), (dict(cuda_graphs=True), "--cuda-graphs"),
    (dict(speculative="eagle3:/x"), "--speculative eagle3"), (dict(pp_layers=(5,)), "--pp-layers names 1 stages"),
    (dict(pp_steps_in_flight=3), "--pp-steps-in-flight must be 0"),
    (dict(pp_steps_in_flight=2, async_scheduling=True), "contradict"),
    (dict(pp_steps_in_flight=2, host_kv_blocks=8), "KV tiers"),
])
def test_combinations_not_supported_are_refused_at_config(kw, refused):
    with pytest.raises(ValueError, match=refused):
        EngineConfig("unused", pp=2, **kw)


@pytest.mark.parametrize("argv", [
    ["--pp", "6"], ["--pp", "2", "--pp-layers", "1,2"], ["--pp", "2", "--pp-layers", "2,x"],
    ["--tp", "2", "--pp", "2", "--device", "cuda"], ["--pp", "2", "--cuda-graphs"],
    ["--pp", "2", "--transports", "cuda_ipc,nats"], ["--pp", "2", "--pp-steps-in-flight", "3"],
])
def test_the_cli_refuses_a_layout_in_one_line(models, capsys, argv):
    from cli import main

    if "cuda" in argv and torch.cuda.device_count() >= 4:
        pytest.skip("this machine has the GPUs")
    rc = main(["worker", "decode", "--model", str(models["dense"]), "--nats", "nats://127.0.0.1:9", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "--pp" in err or "--tp" in err, err


def test_mesh_up_passes_the_pipeline_flags_to_its_workers(models, monkeypatch):
    import cli.localmesh
    from cli import main

    plans = []

    async def fake_run_up(plan):
        plans.append(plan)
        return 0

    monkeypatch.setattr(cli.localmesh, "run_up", fake_run_up)
    assert main(["up", "--model", str(models["dense"]), "--pp", "3", "--pp-layers", "1,1,3",
                 "--pp-steps-in-flight", "1"]) == 0
    flags = plans[0].worker_flags
    assert flags[flags.index("--pp") + 1] == "3" and flags[flags.index("--pp-layers") + 1] == "1,1,3"
    assert flags[flags.index("--pp-steps-in-flight") + 1] == "1"
    assert main(["up", "--mock", "--pp", "2"]) == 2


# -- the KV of a layout: a grid of parts ------------------------------------------------

SPEC = KVCacheSpec(num_layers=5, num_blocks=12, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float32)


def grid(tp: int, stages: tuple[int, ...], paths: list[str] | None = None) -> KVCache | ShardedKVCache:
    """A pool of ``tp`` x ``len(stages)`` parts in rank order (stage-major), as rank 0 holds them."""
    parts = []
    for layers in stages:
        for _ in range(tp):
            spec = KVCacheSpec(layers, SPEC.num_blocks, SPEC.block_size, SPEC.num_kv_heads // tp, SPEC.head_dim,
                               SPEC.dtype)
            parts.append(KVCache(spec, torch.device("cpu"), shm_path=paths[len(parts)] if paths else None))
    return parts[0] if len(parts) == 1 else ShardedKVCache(parts, tp)


GRIDS = {"one": (1, (5,)), "pp2": (1, (2, 3)), "pp3": (1, (1, 2, 2)), "tp2": (2, (5,)), "tp2pp2": (2, (3, 2)),
         "tp4pp2": (4, (1, 4))}


@pytest.mark.parametrize(("src", "dst"), [("one", "pp2"), ("pp2", "one"), ("pp3", "tp2pp2"), ("tp2pp2", "pp2"),
                                          ("tp4pp2", "pp3"), ("tp2", "tp2pp2")])
def test_blocks_move_between_any_two_layouts(src, dst):
    """What shm does (a strided copy per overlap of parts) and what nats does (the whole pool
    block-major, split by the receiver): the same bytes land."""
    full = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(1))
    a = grid(*GRIDS[src])
    a.write_blocks(list(range(SPEC.num_blocks)), full)
    assert a.spec == SPEC and torch.equal(a.read_blocks(list(range(SPEC.num_blocks))), full)
    src_ids, dst_ids = [1, 2, 3, 7, 0], [5, 6, 7, 1, 11]
    b = grid(*GRIDS[dst])
    copy_blocks(a, b, src_ids, dst_ids)
    assert torch.equal(b.read_blocks(dst_ids), full[:, :, src_ids])
    assert not b.read_blocks([i for i in range(SPEC.num_blocks) if i not in dst_ids]).any()
    c = grid(*GRIDS[dst])
    c.write_block_major(dst_ids, a.read_block_major(src_ids))
    assert torch.equal(c.read_blocks(dst_ids), full[:, :, src_ids])


@pytest.mark.parametrize(("src", "dst"), [("one", "tp2pp2"), ("pp3", "one"), ("tp2pp2", "pp3")])
def test_shm_transport_copies_into_each_stages_rank_files(src, dst):
    tp, stages = GRIDS[dst]
    paths = [shm_path(f"test-{secrets.token_hex(3)}-r{r}") for r in range(tp * len(stages))]
    decode_kv = grid(tp, stages, paths)
    receiver = ShmReceiver(decode_kv)
    params = receiver.params("r1", [2, 3])
    assert ("layers" in params.get("shards", [{}])[0]) == (len(stages) > 1)  # a one-stage pool's params are TP's
    full = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(2))
    source = grid(*GRIDS[src])
    source.write_blocks(list(range(SPEC.num_blocks)), full)
    target = TransferTarget(request_id="r1", decode_worker="d", dest_block_ids=[2, 3], block_size=4)
    try:
        sender = ShmSender()
        assert sender.usable(params)
        result = asyncio.run(sender.send(target, params, source, [8, 9]))
        assert result.bytes == 2 * SPEC.block_bytes
        assert torch.equal(decode_kv.read_blocks([2, 3]), full[:, :, [8, 9]])
        if len(stages) > 1:  # shards that do not tile the layers: refused, nothing written
            bad = {**params, "shards": [dict(s, layers=[0, 2]) for s in params["shards"]]}
            with pytest.raises(Refused, match="tile"):
                asyncio.run(ShmSender().send(target, bad, source, [8, 9]))
    finally:
        receiver.close()
        decode_kv.close(unlink=True)
