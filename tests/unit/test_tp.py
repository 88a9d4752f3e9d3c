"""Tensor parallelism in one process tree: a TP=2 engine (rank 0 here, rank 1 a helper
process over gloo) against the TP=1 engine, speculative decoding with each drafter under TP
(EAGLE-3's states captured and rebuilt on rank 0 as at TP 1), and head re-sharding of KV blocks."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import pytest
import torch

import kvstore.cache
from engine.config import EngineConfig
from engine.draft_model import DraftModelDrafter
from engine.engine import Engine
from engine.parallel.group import ParallelGroupError
from engine.sampling import SamplingParams
from engine.spec.adaptive import AcceptancePrior
from engine.spec.registry import create_drafter
from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, copy_block_tensor, copy_blocks
from kvstore.transfer import TransferTarget
from kvstore.transfer.shm import ShmReceiver, ShmSender, shm_path
from mesh.errors import ModelError
from tests.helpers.eagle3 import make_eagle3_checkpoint
from tests.helpers.procs import alive
from tests.helpers.references import prompts_of, run_with_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KW = dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)


def assert_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), "a tensor-parallel rank outlived its engine"


@pytest.fixture(scope="module")
def tiny_pair(tiny_model):
    """TP=1 and TP=2 engines on the tiny model (4 heads, 2 KV heads), chunked prefill on."""
    one = Engine(EngineConfig(tiny_model, **KW))
    two = Engine(EngineConfig(tiny_model, tp=2, **KW))
    yield one, two
    pids = two.ranks.pids
    files = [shard.shm_path for shard in two.kv_cache.shards[1:]]
    assert files and all(os.path.exists(f) for f in files)  # rank 1's KV, mapped here too
    two.close()
    assert_gone(pids)
    assert not any(os.path.exists(f) for f in files)


def test_tp2_is_token_identical_to_tp1_with_chunked_prefill_and_a_prefix_hit(tiny_pair):
    one, two = tiny_pair
    prompts = prompts_of([3, 17, 40, 100, 9, 230], 4096, low=3)
    out1, _, logits1 = run_with_logits(one, prompts, GREEDY)
    out2, _, logits2 = run_with_logits(two, prompts, GREEDY)
    assert out1 == out2
    assert len(logits2) > 12 + 1  # the 230-token prompt took several 64-token chunks
    assert len(logits1) == len(logits2)
    for a, b in zip(logits1, logits2, strict=True):
        assert (a - b).abs().max().item() < 1e-4
    # a prompt sharing the 230-token prompt's first 200 tokens: its full blocks are cached
    shared = [*prompts[5][:200], 5, 6, 7]
    out1, cached1, _ = run_with_logits(one, [shared], GREEDY)
    out2, cached2, _ = run_with_logits(two, [shared], GREEDY)
    assert cached2 == cached1 == [200]
    assert out1 == out2
    assert two.pool.num_used == 0


@pytest.fixture(scope="module")
def spec_tp2(tiny_model, tmp_path_factory):
    """A TP=2 engine built with ``eagle3:DIR`` (a random head reading the inputs of layers 1, 0, 1
    of the tiny model's 2), K=4; a test sets the drafter it runs (``set_drafter``), so every
    drafter shares one pair of ranks. Yields the engine, its EAGLE-3 drafter and the head's dir."""
    head = make_eagle3_checkpoint(tiny_model, tmp_path_factory.mktemp("tp-eagle3") / "head", seed=3,
                                  aux_layers=[1, 0, 1])
    two = Engine(EngineConfig(tiny_model, tp=2, speculative=f"eagle3:{head}", num_speculative_tokens=4, **KW))
    yield two, two.eagle3, head
    pids = two.ranks.pids
    two.close()
    assert_gone(pids)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_tp2_with_speculation_is_token_identical_to_tp1_without(tiny_pair, spec_tp2, tiny_model, method):
    """Speculative decoding under TP: drafts (prompt lookup, the tiny model drafting for itself, or
    an EAGLE-3 head on rank 0 reading the states rank 0 keeps) are verified by both ranks' forward,
    and the output is plain TP 1 decoding's. The random head's drafts are almost never accepted."""
    one, _ = tiny_pair
    two, eagle, _ = spec_tp2
    prompts = [p * 3 for p in prompts_of([6, 9, 12, 7], 4000, 5, low=3)]  # repeats for lookup to find
    want = [s.output_token_ids for s in one.generate(prompts, GREEDY)]
    if method == "ngram":
        two.set_drafter(create_drafter("ngram"))
    elif method == "draft":
        two.set_drafter(DraftModelDrafter(tiny_model, two.model_config, two.device, two.dtype, two.pool.num_blocks,
                                          two.block_size, "torch"))
    else:
        two.set_drafter(eagle)
    counters = two.scheduler.spec
    drafted, accepted = counters.drafted, counters.accepted
    assert [s.output_token_ids for s in two.generate(prompts, GREEDY)] == want
    assert counters.drafted > drafted
    assert counters.accepted > accepted or method == "eagle3"


def test_eagle3_states_under_tp2_are_tp1s_captured_and_rebuilt(tiny_pair, spec_tp2, tiny_model):
    """EAGLE-3 under TP: rank 0 keeps the residual stream, which is whole after each layer's
    all-reduce, so its captured states are TP 1's; the states of tokens not computed here (a
    prefix-cache hit) are rebuilt by a step both ranks run (each holds half the KV heads), and
    equal TP 1's captured ones too; outputs with rebuilt states are plain TP 1 decoding's."""
    one_plain, _ = tiny_pair
    two, eagle, head = spec_tp2
    two.set_drafter(eagle)
    one = Engine(EngineConfig(tiny_model, speculative=f"eagle3:{head}", num_speculative_tokens=4, **KW))
    prompt = prompts_of([45], 4096, seed=21, low=3)[0]
    n = len(prompt)
    captured = []
    for e in (one, two):
        seq = e.new_sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        seq.hold_blocks = True  # its KV stays in place for the rebuild below
        e.add(seq)
        while not seq.is_finished:
            e.step()
        row = e.eagle3.kv.row(seq)
        assert row.start == 0 and len(row.states) == n
        captured.append((seq, row.states))
    (_, states1), (seq2, states2) = captured
    torch.testing.assert_close(states2, states1, rtol=1e-4, atol=1e-4)
    rebuilt = eagle.rebuilt_tokens
    torch.testing.assert_close(eagle._rebuild(seq2, 0, n), states1, rtol=1e-4, atol=1e-4)
    assert eagle.rebuilt_tokens == rebuilt + n
    for e, (seq, _) in zip((one, two), captured, strict=True):
        e.release(seq.request_id)
    one.close()
    # through the scheduler: the same prompts twice, the second time their full blocks are cached
    prompts = prompts_of([30, 41, 17], 4096, seed=22, low=3)
    want = [s.output_token_ids for s in one_plain.generate(prompts, GREEDY)]
    assert [s.output_token_ids for s in two.generate(prompts, GREEDY)] == want
    rebuilt, drafted = eagle.rebuilt_tokens, two.scheduler.spec.drafted
    two.scheduler.spec_prior = AcceptancePrior()  # forget the random head's acceptance (0): new rows draft
    assert [s.output_token_ids for s in two.generate(prompts, GREEDY)] == want
    assert eagle.rebuilt_tokens > rebuilt and two.scheduler.spec.drafted > drafted


def test_rank0_kv_is_the_full_head_set_over_both_ranks(tiny_pair):
    one, two = tiny_pair
    assert isinstance(two.kv_cache, ShardedKVCache)
    assert two.kv_cache.spec == one.kv_cache.spec  # 2 KV heads in all, one per rank
    assert [(p.layers, p.heads) for p in two.kv_cache.parts()] == [((0, 2), (0, 1)), ((0, 2), (1, 2))]
    # the same prompt leaves the same KV bytes, whichever rank computed a head
    prompt = prompts_of([50], 4096, seed=9, low=3)[0]
    blocks, seqs = [], []
    for e in (one, two):
        seq = e.new_sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        seq.hold_blocks = True  # as a prefill worker does: the blocks stay ours until release
        e.add(seq)
        while not seq.is_finished:
            e.step()
        blocks.append(list(seq.block_table))
        seqs.append(seq)
    a = one.kv_cache.read_blocks(blocks[0])
    b = two.kv_cache.read_blocks(blocks[1])
    assert a.shape[2] == 7 and a.abs().max() > 0
    assert (a - b).abs().max().item() < 1e-4
    for e, seq in zip((one, two), seqs, strict=True):
        e.release(seq.request_id)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama_tied"])
def test_hf_checkpoints_tp2_matches_tp1(hf_checkpoints, family):
    """qwen2: the q/k/v biases are sharded with their heads; qwen3: per-head q/k norms
    (replicated) and head_dim != hidden / heads; llama_tied: a tied, replicated lm_head."""
    path = hf_checkpoints[family]
    prompts = prompts_of([5, 33, 64], 512, seed=3, low=3)
    one = Engine(EngineConfig(path, num_kv_blocks=64))
    out1, _, logits1 = run_with_logits(one, prompts, GREEDY)
    two = Engine(EngineConfig(path, num_kv_blocks=64, tp=2))
    try:
        out2, _, logits2 = run_with_logits(two, prompts, GREEDY)
    finally:
        two.close()
    assert out1 == out2
    for a, b in zip(logits1, logits2, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_a_dead_rank_fails_the_step_and_every_later_one(tiny_model):
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=64, tp=2))
    pids = engine.ranks.pids
    try:
        assert engine.generate([[5, 6, 7]], GREEDY)[0].num_output_tokens == 12
        os.kill(pids[0], signal.SIGKILL)
        assert_gone(pids)
        with pytest.raises(RuntimeError):
            engine.generate([[5, 6, 7, 8]], GREEDY)
        with pytest.raises(ParallelGroupError, match="closed"):
            engine.generate([[9, 10]], GREEDY)
    finally:
        engine.close()


def test_tp_must_divide_heads_and_excludes_kv_tiers(tiny_model):
    with pytest.raises(ModelError, match="--tp 3"):
        Engine(EngineConfig(tiny_model, tp=3))
    with pytest.raises(ValueError, match="tiers"):
        EngineConfig(tiny_model, tp=2, host_kv_blocks=16)
    with pytest.raises(ValueError, match="tp"):
        EngineConfig(tiny_model, tp=0)


def test_cli_tp_flag_reaches_the_engine_config_and_mesh_up(tiny_model, tmp_path, monkeypatch):
    """With every drafter too: ``--tp 2 --speculative eagle3:DIR`` is a config the engine runs
    (``test_tp2_with_speculation_is_token_identical_to_tp1_without[eagle3]``), not a refusal."""
    import cli.localmesh
    from cli import CliError, build_parser, engine_config, main

    args = build_parser().parse_args(["worker", "decode", "--model", str(tiny_model), "--tp", "2"])
    assert engine_config(args).tp == 2
    eagle = f"eagle3:{tmp_path / 'head'}"
    spec = ["--speculative", eagle, "--num-speculative-tokens", "3"]
    config = engine_config(build_parser().parse_args(["worker", "decode", "--model", str(tiny_model), "--tp", "2",
                                                      *spec]))
    assert (config.tp, config.speculative, config.num_speculative_tokens) == (2, eagle, 3)
    with pytest.raises(ModelError):
        engine_config(build_parser().parse_args(["worker", "decode", "--model", str(tiny_model), "--tp", "3"]))
    with pytest.raises(CliError):
        engine_config(build_parser().parse_args(["worker", "mock", "--tp", "2"]), mock=True)
    plans = []

    async def fake_run_up(plan):
        plans.append(plan)
        return 0

    monkeypatch.setattr(cli.localmesh, "run_up", fake_run_up)
    assert main(["up", "--model", str(tiny_model), "--tp", "2"]) == 0
    flags = plans[0].worker_flags
    assert flags[flags.index("--tp") + 1] == "2"
    assert main(["up", "--model", str(tiny_model), "--tp", "2", *spec]) == 0
    flags = plans[1].worker_flags
    assert flags[flags.index("--tp") + 1] == "2" and flags[flags.index("--speculative") + 1] == eagle


# -- head re-sharding of KV blocks ----------------------------------------------------

SPEC = KVCacheSpec(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float32)


def sharded(tp: int, paths: list[str] | None = None) -> KVCache | ShardedKVCache:
    spec = KVCacheSpec(SPEC.num_layers, SPEC.num_blocks, SPEC.block_size, SPEC.num_kv_heads // tp,
                       SPEC.head_dim, SPEC.dtype)
    shards = [KVCache(spec, torch.device("cpu"), shm_path=paths[r] if paths else None) for r in range(tp)]
    return shards[0] if tp == 1 else ShardedKVCache(shards)


def filled(tp: int, seed: int = 0) -> tuple[KVCache | ShardedKVCache, torch.Tensor]:
    kv = sharded(tp)
    full = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(seed))
    kv.write_blocks(list(range(SPEC.num_blocks)), full)
    return kv, full


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2), (1, 1)])
def test_copy_blocks_reshards_heads(src_tp, dst_tp):
    src, full = filled(src_tp)
    assert torch.equal(src.read_blocks(list(range(SPEC.num_blocks))), full)
    dst = sharded(dst_tp)
    src_ids, dst_ids = [1, 2, 3, 7, 0], [5, 6, 7, 1, 11]
    copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst.read_blocks(dst_ids), full[:, :, src_ids])
    untouched = [b for b in range(SPEC.num_blocks) if b not in dst_ids]
    assert not dst.read_blocks(untouched).any()


@pytest.mark.parametrize("gather_bytes", [1, 1 << 30], ids=["layer-by-layer", "all-layers"])
def test_indexed_block_copy_equals_the_run_by_run_copy(gather_bytes, monkeypatch):
    """The gather/scatter a GPU uses for scattered blocks, forced on CPU: same bytes as the runs."""
    monkeypatch.setattr(kvstore.cache, "GATHER_BYTES", gather_bytes)
    src = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(3))
    src_ids, dst_ids = [0, 1, 2, 5, 9, 4, 11], [10, 3, 4, 0, 8, 7, 1]
    by_runs, by_index = torch.zeros(SPEC.shape), torch.zeros(SPEC.shape)
    copy_block_tensor(by_runs, src, src_ids, dst_ids, indexed=False)
    copy_block_tensor(by_index, src, src_ids, dst_ids, indexed=True)
    assert torch.equal(by_index, by_runs)
    assert torch.equal(by_index[:, :, dst_ids], src[:, :, src_ids])
    # through a head slice (a re-sharding copy) and into another dtype
    half = torch.zeros(SPEC.shape, dtype=torch.bfloat16)
    copy_block_tensor(half[:, :, :, :, 2:], src[:, :, :, :, :2], src_ids, dst_ids, indexed=True)
    assert torch.equal(half[:, :, dst_ids, :, 2:], src[:, :, src_ids, :, :2].bfloat16())
    assert not half[:, :, :, :, :2].any()


def test_block_major_bytes_are_the_same_whatever_the_sharding():
    """What the nats transport sends (the full head set, block-major) and how it lands."""
    one, _ = filled(1, seed=4)
    two, _ = filled(2, seed=4)
    ids = [3, 0, 9]
    data = two.read_block_major(ids)
    assert torch.equal(data, one.read_block_major(ids))
    dst = sharded(2)
    dst.write_block_major([4, 5, 6], data)
    assert torch.equal(dst.read_blocks([4, 5, 6]), one.read_blocks(ids))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1)])
def test_shm_transport_reshards_into_the_decode_workers_rank_files(tmp_path, src_tp, dst_tp):
    paths = [shm_path(f"test-{secrets.token_hex(3)}-r{r}") for r in range(dst_tp)]  # the mesh's KV directory
    decode_kv = sharded(dst_tp, paths)
    receiver = ShmReceiver(decode_kv)
    params = receiver.params("r1", [2, 3])
    assert ("shards" in params) == (dst_tp > 1)  # TP 1 params are what they always were
    src, full = filled(src_tp, seed=2)
    sender = ShmSender()
    assert sender.usable(params)
    target = TransferTarget(request_id="r1", decode_worker="d", dest_block_ids=[2, 3], block_size=4)
    result = asyncio.run(sender.send(target, params, src, [8, 9]))
    assert result.bytes == 2 * SPEC.block_bytes
    assert torch.equal(decode_kv.read_blocks([2, 3]), full[:, :, [8, 9]])
    decode_kv.close(unlink=True)
