"""The engine with KV tiers on the tiny model: a device pool too small for the working set,
offloaded blocks onboarded on a prefix hit, and greedy output identical to an unlimited pool.

A conversation re-sends its whole history every turn (history + the model's answer + a new
user message), so from the second turn on most of each prompt is a prefix hit, if the blocks
survived somewhere.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import SampledToken
from tests.helpers.tiers import offload_and_onboard

CONVS = 4
FIRST = 120  # tokens of a conversation's first prompt
USER = 40  # tokens of each later user message
ANSWER = 8  # tokens of each answer
TURNS = 5
GREEDY = SamplingParams(max_tokens=ANSWER, temperature=0.0)


def user_messages(seed: int = 1):
    rng = random.Random(seed)
    first = [[rng.randrange(3, 4096) for _ in range(FIRST)] for _ in range(CONVS)]
    later = [[[rng.randrange(3, 4096) for _ in range(USER)] for _ in range(CONVS)] for _ in range(TURNS)]
    return first, later


class Chat:
    """Conversations driven turn by turn; each turn's prompt is built from this engine's own answers."""

    def __init__(self):
        self.first, self.later = user_messages()
        self.histories = [list(p) for p in self.first]
        self.turn = 0

    def prompts(self) -> list[list[int]]:
        return [list(h) for h in self.histories]

    def answer(self, seqs) -> None:
        for i, s in enumerate(seqs):
            self.histories[i] = [*self.histories[i], *s.output_token_ids, *self.later[self.turn][i]]
        self.turn += 1


def run_turns(engine: Engine, chat: Chat, turns: int, batched: bool = False):
    """(outputs, cached tokens) per request, turn by turn, conversations in round-robin order."""
    outs, cached = [], []
    for _ in range(turns):
        prompts = chat.prompts()
        seqs = engine.generate(prompts, GREEDY) if batched else [engine.generate([p], GREEDY)[0] for p in prompts]
        outs += [s.output_token_ids for s in seqs]
        cached += [s.num_cached_tokens for s in seqs]
        chat.answer(seqs)
    return outs, cached


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Every turn on an unlimited device pool: the outputs and cached tokens to match."""
    engine, chat = Engine(EngineConfig(tiny_model, num_kv_blocks=2048)), Chat()
    outs, cached = run_turns(engine, chat, TURNS - 1)
    last_prompts = chat.prompts()
    more_outs, more_cached = run_turns(engine, chat, 1)
    return outs + more_outs, cached + more_cached, last_prompts


def test_multi_turn_with_a_host_tier_matches_an_unlimited_pool(tiny_model, reference):
    ref_out, ref_cached, _ = reference
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=32, host_kv_blocks=512))
    outs, cached = run_turns(engine, Chat(), TURNS)
    assert outs == ref_out
    assert cached == ref_cached  # every block of every history was found again
    c = engine.kv_counters()
    assert c["hit_blocks_host"] > 0 and c["host_blocks"] > 0 and c["host_stored_blocks"] == c["host_blocks"]
    # the device alone could not have served these hits
    plain = Engine(EngineConfig(tiny_model, num_kv_blocks=32))
    plain_outs, plain_cached = run_turns(plain, Chat(), TURNS)
    assert plain_outs == ref_out and sum(plain_cached) < sum(cached) // 2
    assert c["hit_blocks_host"] * 16 > sum(plain_cached)


def test_preempted_sequences_come_back_through_the_host_tier(tiny_model):
    """Two long conversations decoding at once outgrow a 40-block device pool: one is preempted,
    its blocks are offloaded while the other runs, and its recompute is an onboarding."""
    rng = random.Random(5)
    firsts = [[rng.randrange(3, 4096) for _ in range(300)] for _ in range(2)]
    params = SamplingParams(max_tokens=40, temperature=0.0)

    def turns(engine):
        histories, outs = [list(f) for f in firsts], []
        for _ in range(2):
            seqs = engine.generate(histories, params)
            outs += [s.output_token_ids for s in seqs]
            histories = [[*h, *s.output_token_ids, 5, 6, 7] for h, s in zip(histories, seqs, strict=True)]
        return outs

    expected = turns(Engine(EngineConfig(tiny_model, num_kv_blocks=1024)))
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=40, host_kv_blocks=512))
    assert turns(engine) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv_counters()["hit_blocks_host"] > 0
    assert engine.pool.num_used == 0  # every block came back


def test_onboarded_blocks_hold_the_computed_bytes(tiny_model):
    """What a prefill worker sends from its own tiers: held blocks, onboarded from the host tier."""
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=24, host_kv_blocks=64))
    computed, again = offload_and_onboard(engine, GREEDY)
    assert again.num_cached_tokens == 12 * 16
    assert torch.equal(engine.kv_cache.read_blocks(again.block_table[:12]), computed)
    assert engine.kv_counters()["hit_blocks_host"] == 12
    engine.release(again.request_id)
    assert engine.pool.num_used == 0


def test_remote_prefill_reservation_onboards_host_hits(tiny_model):
    """The decode side of disaggregation: the reserved destination blocks start after the onboarded
    prefix, a prefill worker fills them, and decoding continues token-identical."""
    decode = Engine(EngineConfig(tiny_model, num_kv_blocks=24, host_kv_blocks=64))
    prefill = Engine(EngineConfig(tiny_model, num_kv_blocks=256))
    rng = random.Random(4)
    turn1 = [rng.randrange(3, 4096) for _ in range(150)]
    (s1,) = decode.generate([turn1], GREEDY)
    decode.generate([[rng.randrange(3, 4096) for _ in range(370)]], GREEDY)  # evicts turn 1 to the host
    turn2 = [*turn1, *s1.output_token_ids, *(rng.randrange(3, 4096) for _ in range(60))]
    expected = prefill.generate([turn2], GREEDY)[0].output_token_ids

    seq = decode.new_sequence(turn2, GREEDY, request_id="remote")
    hits = (len(turn1) + ANSWER - 1) // 16  # the full blocks of turn 1 and its computed answer
    assert decode.num_uncached_tokens(seq) == len(turn2) - hits * 16
    assert decode.reserve_remote(seq)
    assert seq.num_cached_tokens == hits * 16 and decode.kv_counters()["hit_blocks_host"] == hits
    dest = seq.block_table[hits:]
    assert len(dest) == -(-len(turn2) // 16) - hits
    assert len(set(seq.block_table)) == len(seq.block_table)

    job = prefill.new_sequence(turn2, SamplingParams(max_tokens=1, temperature=0.0))
    job.hold_blocks = True
    prefill.add(job)
    while not job.is_finished:
        prefill.step()
    decode.kv_cache.write_blocks(dest, prefill.kv_cache.read_blocks(job.block_table[hits:]))  # the transport
    prefill.release(job.request_id)
    decode.complete_remote("remote", SampledToken(job.output_token_ids[0]))
    while not seq.is_finished:
        decode.step()
    assert seq.output_token_ids == expected


# -- the disk tier --------------------------------------------------------------------------------


def disk_config(model, root, **kw):
    return EngineConfig(model, num_kv_blocks=24, host_kv_blocks=24, disk_kv_dir=str(root), **kw)


@pytest.fixture(scope="module")
def disk_dir(tiny_model, tmp_path_factory):
    """A disk tier written by a first engine: four turns of the conversations."""
    root = tmp_path_factory.mktemp("diskkv")
    engine = Engine(disk_config(tiny_model, root))
    run_turns(engine, Chat(), TURNS - 1)
    c = engine.kv_counters()
    assert c["disk_written_blocks"] > 0 and c["disk_blocks"] > 0
    return root


def test_disk_blocks_survive_a_restart(tiny_model, reference, disk_dir, tmp_path):
    ref_out, _, last_prompts = reference
    root = tmp_path / "kv"
    shutil.copytree(disk_dir, root)
    engine = Engine(disk_config(tiny_model, root))  # a restarted worker: empty device and host
    assert len(engine.tiers.disk) > 0
    outs, cached = [], []
    for p in last_prompts:
        (s,) = engine.generate([p], GREEDY)
        outs.append(s.output_token_ids)
        cached.append(s.num_cached_tokens)
    assert outs == ref_out[-CONVS:]
    c = engine.kv_counters()
    assert c["hit_blocks_disk"] > 0 and c["disk_corrupt_blocks"] == 0
    assert sum(cached) >= c["hit_blocks_disk"] * 16 > 0


def test_corrupt_and_truncated_disk_blocks_are_recomputed(tiny_model, reference, disk_dir, tmp_path):
    ref_out, _, last_prompts = reference
    root = tmp_path / "kv"
    shutil.copytree(disk_dir, root)
    probe = Engine(EngineConfig(tiny_model, num_kv_blocks=64))
    (sub,) = [p for p in root.iterdir() if p.is_dir()]

    def leading_on_disk(prompt):
        hashes = probe.new_sequence(prompt, GREEDY).block_hashes((len(prompt) - 1) // 16)
        n = 0
        while n < len(hashes) and (sub / f"{hashes[n]:016x}.kv").exists():
            n += 1
        return hashes, n

    prompts = last_prompts
    h0, n0 = leading_on_disk(prompts[0])
    h1, n1 = leading_on_disk(prompts[1])
    assert n0 >= 3 and n1 >= 3, (n0, n1)
    flipped = sub / f"{h0[2]:016x}.kv"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit of the payload
    flipped.write_bytes(bytes(raw))
    truncated = sub / f"{h1[1]:016x}.kv"
    truncated.write_bytes(truncated.read_bytes()[:-100])

    engine = Engine(disk_config(tiny_model, root))
    outs, cached = [], []
    for p in prompts[:2]:
        (s,) = engine.generate([p], GREEDY)
        outs.append(s.output_token_ids)
        cached.append(s.num_cached_tokens)
    assert outs == ref_out[-CONVS:][:2]
    assert cached == [2 * 16, 1 * 16]  # each hit ends at the bad block
    assert engine.kv_counters()["disk_corrupt_blocks"] == 2
    assert not flipped.exists() and not truncated.exists()


def test_tier_flags_reach_the_engine_config(tiny_model, tmp_path, monkeypatch):
    from cli import CliError, build_parser, engine_config

    args = build_parser().parse_args(["worker", "decode", "--model", str(tiny_model), "--device-kv-blocks", "64",
                                      "--host-kv-gb", "0.5", "--disk-kv-dir", str(tmp_path), "--disk-kv-gb", "2"])
    cfg = engine_config(args)
    assert (cfg.num_kv_blocks, cfg.host_kv_gb, cfg.disk_kv_dir, cfg.disk_kv_gb) == (64, 0.5, str(tmp_path), 2.0)
    engine = Engine(cfg)
    assert engine.tiers.host.num_slots == int(0.5 * (1 << 30)) // engine.kv_spec.block_bytes
    assert engine.tiers.disk is not None and set(engine.kv_snapshot()) == {"device", "host", "disk"}
    plain = engine_config(build_parser().parse_args(["worker", "decode", "--model", str(tiny_model)]))
    assert plain.host_kv_gb == 0 and plain.disk_kv_dir is None
    with pytest.raises(CliError):
        engine_config(build_parser().parse_args(["worker", "mock", "--host-kv-gb", "1"]), mock=True)
    with pytest.raises(ValueError, match="host"):
        EngineConfig(tiny_model, disk_kv_dir=str(tmp_path))

    import cli.localmesh
    from cli import main

    plans = []

    async def fake_run_up(plan):
        plans.append(plan)
        return 0

    monkeypatch.setattr(cli.localmesh, "run_up", fake_run_up)
    assert main(["up", "--model", str(tiny_model), "--device-kv-blocks", "64", "--host-kv-gb", "0.5",
                 "--disk-kv-dir", str(tmp_path), "--disk-kv-gb", "2"]) == 0
    flags = plans[0].worker_flags
    for flag, value in [("--host-kv-gb", "0.5"), ("--disk-kv-dir", str(tmp_path)), ("--disk-kv-gb", "2.0")]:
        assert flags[flags.index(flag) + 1] == value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_is_token_identical_through_host_and_disk(tiny_model, tmp_path):
    """The CUDA path: pinned host slots, copies on a side stream the step waits for, disk files
    written from pinned memory and read back after a restart."""
    kw = dict(device="cuda", dtype="float32")
    ref = Engine(EngineConfig(tiny_model, num_kv_blocks=2048, **kw))
    ref_chat = Chat()
    expected, _ = run_turns(ref, ref_chat, TURNS - 1)
    last_prompts = ref_chat.prompts()
    expected_last, _ = run_turns(ref, ref_chat, 1)

    config = EngineConfig(tiny_model, num_kv_blocks=24, host_kv_blocks=24, disk_kv_dir=str(tmp_path), **kw)
    engine = Engine(config)
    copier = engine.tiers.copier
    assert copier.stream is not None and copier.slots.is_pinned()
    outs, _ = run_turns(engine, Chat(), TURNS - 1)
    assert outs == expected
    c = engine.kv_counters()
    assert c["hit_blocks_host"] > 0 and c["disk_written_blocks"] > 0
    torch.cuda.synchronize()
    restarted = Engine(config)
    outs = [restarted.generate([p], GREEDY)[0].output_token_ids for p in last_prompts]
    assert outs == expected_last and restarted.kv_counters()["hit_blocks_disk"] > 0


def test_model_workers_take_their_tiers_in_blocks_too(tiny_model, tmp_path):
    from cli import build_parser, engine_config
    from kvstore.disk import HEADER

    args = build_parser().parse_args(["worker", "decode", "--model", str(tiny_model), "--device-kv-blocks", "64",
                                      "--host-kv-blocks", "32", "--disk-kv-dir", str(tmp_path),
                                      "--disk-kv-blocks", "16"])
    cfg = engine_config(args)
    assert (cfg.host_kv_blocks, cfg.disk_kv_blocks) == (32, 16)
    engine = Engine(cfg)
    assert engine.tiers.host.num_slots == 32
    assert engine.tiers.disk.capacity_bytes == 16 * (HEADER.size + engine.kv_spec.block_bytes)
    with pytest.raises(ValueError, match="directory"):
        EngineConfig(tiny_model, host_kv_blocks=8, disk_kv_blocks=8)
