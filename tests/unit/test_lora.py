"""Multi-LoRA in the engine against transformers + peft, the slots, the batched LoRA matmul,
adapter-seeded prefix caching, and broken adapter directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.lora_layers import LoraBatch, LoraSlots, Projection, TableEntry, add_lora
from engine.sampling import SamplingParams
from kvstore.hashing import hash_seed
from mesh.errors import LoraError, UnknownAdapterError
from tests.helpers.lora import peft_references
from tests.helpers.references import prompts_of

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = prompts_of([5, 40, 70], 4096, low=8)


@pytest.fixture(scope="module")
def lora_reference(tiny_model, tmp_path_factory):
    """Adapters made by peft on the tiny model, and transformers + peft greedy outputs of every
    prompt under each adapter (key None: the base model)."""
    dirs, expected = peft_references(tiny_model, tmp_path_factory.mktemp("lora"), PROMPTS, MAX_TOKENS)
    return tiny_model, dirs, expected


def lora_engine(lora_reference, **kw):
    model, dirs, _ = lora_reference
    kw = {"num_kv_blocks": 256, "loras": tuple(dirs.items()), **kw}
    return Engine(EngineConfig(model, **kw))


# -- against transformers + peft ----------------------------------------------------------


def test_each_adapter_matches_transformers_with_peft(lora_reference):
    _, _, expected = lora_reference
    assert len({tuple(map(tuple, out)) for out in expected.values()}) == 4  # every adapter changes the output
    engine = lora_engine(lora_reference)
    for name, want in expected.items():
        seqs = engine.generate(PROMPTS, GREEDY, lora=name)
        assert [s.output_token_ids for s in seqs] == want, name


@pytest.mark.parametrize("budget", [2048, 24])
def test_one_batch_mixes_three_adapters_and_the_base(lora_reference, budget):
    """Every prompt under every adapter and the base in one run; with a 24-token budget the
    prompts are chunked and steps mix prefill chunks of some adapters with decodes of others."""
    _, _, expected = lora_reference
    engine = lora_engine(lora_reference, max_num_batched_tokens=budget)
    names = [name for name in expected for _ in PROMPTS]
    prompts = [p for _ in expected for p in PROMPTS]
    seqs = engine.generate(prompts, GREEDY, lora=names)
    got = {name: [] for name in expected}
    for name, seq in zip(names, seqs, strict=True):
        got[name].append(seq.output_token_ids)
    assert got == expected
    if budget == 2048:  # one prefill step for all twelve, then one decode step per token: one batch
        assert engine.num_steps == MAX_TOKENS
    assert engine.pool.num_used == 0


def test_preemption_keeps_each_request_on_its_adapter(lora_reference):
    _, _, expected = lora_reference
    engine = lora_engine(lora_reference, num_kv_blocks=24, block_size=4)
    names = [name for name in expected for _ in PROMPTS[:2]]
    seqs = engine.generate([p for _ in expected for p in PROMPTS[:2]], GREEDY, lora=names)
    assert engine.scheduler.num_preemptions > 0
    for i, (name, seq) in enumerate(zip(names, seqs, strict=True)):
        assert seq.output_token_ids == expected[name][i % 2], name


# -- prefix caching per adapter -----------------------------------------------------------


def test_prefixes_are_cached_per_adapter(lora_reference):
    _, _, expected = lora_reference
    engine = lora_engine(lora_reference)
    prompt = PROMPTS[2]  # 70 tokens: 4 full blocks of 16
    (a,) = engine.generate([prompt], GREEDY, lora="all")
    (b,) = engine.generate([prompt], GREEDY, lora="attn")
    (base,) = engine.generate([prompt], GREEDY)
    (a2,) = engine.generate([prompt], GREEDY, lora="all")
    assert (a.num_cached_tokens, b.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 64
    assert a.output_token_ids == a2.output_token_ids == expected["all"][2]
    assert b.output_token_ids == expected["attn"][2] and base.output_token_ids == expected[None][2]
    assert len({a.hash_seed, b.hash_seed, base.hash_seed}) == 3
    assert a.hash_seed == hash_seed(engine.hash_key, engine.model_name, lora="all")
    assert base.hash_seed == hash_seed(engine.hash_key, engine.model_name) == engine.hash_seed


# -- loading at runtime, slots ------------------------------------------------------------


def test_runtime_load_unload_and_more_adapters_than_slots(lora_reference):
    """Two slots, three adapters loaded at runtime: a batch of all three runs two at a time
    (the third waits for a slot), least recently used out; an unloaded adapter's running
    request finishes, new ones are refused."""
    model, dirs, expected = lora_reference
    engine = Engine(EngineConfig(model, num_kv_blocks=256, max_loras=2))
    for name, path in dirs.items():
        engine.load_lora(name, str(path))
    assert engine.load_lora("all", str(dirs["all"])) is engine.lora.get("all")  # same directory again: no-op
    names = ["all", "attn", "mlp", "all"]
    seqs = engine.generate([PROMPTS[1]] * 4, GREEDY, lora=names)
    assert [s.output_token_ids for s in seqs] == [expected[n][1] for n in names]
    assert engine.num_steps > MAX_TOKENS  # "mlp" could not join the first batch
    held = [a.name if a else None for a in engine.lora.slots.held]
    assert "mlp" in held and len(held) == 2

    running = engine.new_sequence(PROMPTS[0], GREEDY, lora="attn")
    engine.add(running)
    engine.step()
    assert engine.unload_lora("attn") and not engine.unload_lora("attn")
    with pytest.raises(UnknownAdapterError, match="unknown LoRA adapter 'attn'"):
        engine.new_sequence(PROMPTS[0], GREEDY, lora="attn")
    while engine.has_work:
        engine.step()
    assert running.output_token_ids == expected["attn"][0]
    with pytest.raises(LoraError, match="served other weights before"):
        engine.load_lora("attn", str(dirs["mlp"]))  # its cached prefixes would be stale
    with pytest.raises(LoraError, match="already loaded"):
        engine.load_lora("all", str(dirs["mlp"]))


def test_lora_off_and_bad_configs(lora_reference):
    model, dirs, _ = lora_reference
    engine = Engine(EngineConfig(model, num_kv_blocks=16))
    assert engine.lora is None
    with pytest.raises(UnknownAdapterError):
        engine.new_sequence([1, 2], GREEDY, lora="all")
    with pytest.raises(LoraError, match="--max-loras"):
        engine.load_lora("all", str(dirs["all"]))
    with pytest.raises(ValueError, match="unique"):
        EngineConfig(model, loras=(("a", str(dirs["all"])), ("a", str(dirs["mlp"]))))
    with pytest.raises(ValueError, match="tp > 1"):
        EngineConfig(model, tp=2, loras=(("a", str(dirs["all"])),))
    with pytest.raises(ValueError, match="disk KV tier"):
        EngineConfig(model, max_loras=2, host_kv_blocks=8, disk_kv_dir="/tmp/x")
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: rank 16 of mlp\.\w+ exceeds the engine's max LoRA rank 8"):
        Engine(EngineConfig(model, num_kv_blocks=16, max_lora_rank=8, loras=(("m", str(dirs["mlp"])),)))


def test_slots_place_adapters_in_front_least_recently_used_out():
    a, b, c, d = (object() for _ in range(4))
    slots = LoraSlots(3)
    assert [x.kind for x in slots.place([a, b])] == ["load", "load"]
    assert set(map(id, slots.held[:2])) == {id(a), id(b)}
    assert slots.place([a, b]) == []  # resident in front: nothing to copy
    copies = slots.place([c])  # c takes a front slot; what it displaces moves to the free slot
    assert [x.kind for x in copies] == ["move", "load"] and slots.held[0] is c
    copies = slots.place([a, b])  # both resident: swapped into the front, no load
    assert {x.kind for x in copies} <= {"swap"} and {id(x) for x in slots.held[:2]} == {id(a), id(b)}
    slots.place([d])  # c is the least recently used: d replaces it
    assert c not in slots.held and d in slots.held and a in slots.held and b in slots.held
    with pytest.raises(ValueError, match="only 3 LoRA slots"):
        slots.place([a, b, c, d])
    slots.forget(d)
    assert d not in slots.held


@pytest.mark.parametrize("lens", [[1, 1, 1, 1, 1, 1], [40, 1, 1, 3], [5, 1, 2]])
def test_batched_and_per_slot_lora_matmuls_agree_with_the_definition(lens):
    """Rows of three adapters and the base model, decode-shaped (the batched bmm form) and
    prefill-shaped (one matmul pair per slot), and one adapter for every row (no gather),
    against y + (x A_s) B_s row by row."""
    g = torch.Generator().manual_seed(0)
    proj = Projection("qkv", 24, (16, 8, 8))
    entry = TableEntry(proj, size=4, rank=4, device=torch.device("cpu"), dtype=torch.float32)
    for t in (entry.a, *entry.b):
        t.copy_(torch.randn(t.shape, generator=g))
    slots = {6: [0, 2, -1, 1, 0, 2], 4: [1, 0, -1, 2], 3: [0, 0, 0]}[len(lens)]
    batch = LoraBatch.plan(lens, slots, torch.device("cpu"))
    assert (batch.gather is not None) == (len(lens) == 6)
    assert batch.identity == (len(lens) == 3)
    x = torch.randn(sum(lens), 24, generator=g)
    y = torch.randn(sum(lens), 32, generator=g)
    want = y.clone()
    row = 0
    for n, s in zip(lens, slots, strict=True):
        for r in range(row, row + n):
            if s >= 0:
                h = x[r] @ entry.a[s]
                want[r] += torch.cat([h[j * 4 : (j + 1) * 4] @ entry.b[j][s] for j in range(3)])
        row += n
    add_lora(y, x, entry, batch)
    torch.testing.assert_close(y, want)
    assert LoraBatch.plan([3, 2], [-1, -1], torch.device("cpu")) is None


# -- broken adapter directories ------------------------------------------------------------


def _broken(case: str, good, tmp_path):
    bad = tmp_path / case
    bad.mkdir()
    cfg = json.loads((good / "adapter_config.json").read_text())
    weights = (good / "adapter_model.safetensors").read_bytes()
    if case == "no_config":
        (bad / "adapter_model.safetensors").write_bytes(weights)
        return bad, f"{bad} has no adapter_config.json"
    if case == "bad_json":
        (bad / "adapter_config.json").write_text("{nope")
        return bad, f"{bad / 'adapter_config.json'} is not valid JSON"
    (bad / "adapter_config.json").write_text(json.dumps(cfg | ({"use_dora": True} if case == "dora" else {})))
    if case == "dora":
        (bad / "adapter_model.safetensors").write_bytes(weights)
        return bad, "DoRA (use_dora) is not supported"
    if case == "no_weights":
        return bad, f"{bad} has no adapter_model.safetensors"
    if case == "truncated":
        (bad / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
        return bad, f"cannot read {bad / 'adapter_model.safetensors'}"
    from safetensors.torch import save_file

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors = {"lm_head": {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                           "base_model.model.lm_head.lora_B.weight": torch.zeros(4096, 8)},
               "shape": {key: torch.zeros(8, 63), key.replace("lora_A", "lora_B"): torch.zeros(64, 8)},
               "half_pair": {key: torch.zeros(8, 64)}}[case]
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    return bad, {"lm_head": "is not a LoRA weight of a q/k/v/o/gate/up/down projection",
                 "shape": "self_attn.q_proj of layer 0 has lora_A (8, 63)",
                 "half_pair": "self_attn.q_proj of layer 0 has no lora_B"}[case]


@pytest.mark.parametrize("case", ["missing", "no_config", "bad_json", "dora", "no_weights", "truncated",
                                  "lm_head", "shape", "half_pair"])
def test_a_broken_adapter_is_one_clear_error_naming_the_file(lora_reference, tmp_path, case):
    model, dirs, _ = lora_reference
    if case == "missing":
        bad, expect = tmp_path / "nowhere", f"LoRA adapter directory {tmp_path / 'nowhere'} does not exist"
    else:
        bad, expect = _broken(case, dirs["all"], tmp_path)
    engine = Engine(EngineConfig(model, num_kv_blocks=16, max_loras=1))
    with pytest.raises(LoraError) as err:
        engine.load_lora("x", str(bad))
    message = str(err.value)
    assert expect in message and "\n" not in message
    assert engine.lora.names == []  # nothing half-loaded
    if case == "truncated":  # and the CLI says it in one line, exit status 2
        r = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(model),
                            "--lora", f"x={bad}", "--adapter", "x", "hi"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"mesh: error: {message}"]


def test_generate_cli_runs_prompts_on_their_adapters(lora_reference):
    model, dirs, _ = lora_reference
    r = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(model), "--json",
                        "--max-tokens", "8", "--ignore-eos", "--lora", f"all={dirs['all']}",
                        "--lora", f"mlp={dirs['mlp']}", "--adapter", "all", "--adapter", "", "--adapter", "mlp",
                        "Hello there", "Hello there", "Hello there"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["adapter"] for line in lines] == ["all", None, "mlp"]
    engine = lora_engine(lora_reference)
    for line in lines:
        (seq,) = engine.generate([line["prompt_token_ids"]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True), lora=line["adapter"])
        assert line["token_ids"] == seq.output_token_ids
    assert len({tuple(line["token_ids"]) for line in lines}) == 3
