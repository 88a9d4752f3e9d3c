"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) against Hugging Face transformers,
the grouped experts backend on its own, and MoE under tensor parallelism."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loader as loader
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.moe import GroupedExperts, SparseMoE, TopKRouter
from engine.sampling import SamplingParams
from engine.tiny import write_tiny_model
from mesh.errors import ModelError
from tests.helpers.checkpoints import make_moe_checkpoint
from tests.helpers.references import (
    assert_logits_match_transformers,
    hf_greedy,
    hf_model,
    prompts_of,
    run_with_logits,
)

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: make_moe_checkpoint(f, root / f) for f in FAMILIES}


# -- configuration -------------------------------------------------------------------


def test_configs_pick_sparse_layers_and_normalisation(moe_checkpoints):
    q3 = ModelConfig.from_dir(moe_checkpoints["qwen3_moe"])
    assert (q3.family, q3.qk_norm, q3.moe.norm_topk_prob) == ("qwen3_moe", True, True)
    assert q3.moe.sparse_layers == (0, 2)  # mlp_only_layers=[1]
    mx = ModelConfig.from_dir(moe_checkpoints["mixtral"])
    assert (mx.moe.num_experts, mx.moe.top_k, mx.moe.norm_topk_prob) == (6, 2, True)
    assert mx.moe.sparse_layers == (0, 1)
    q2 = ModelConfig.from_dir(moe_checkpoints["qwen2_moe"])
    assert (q2.qkv_bias, q2.moe.norm_topk_prob, q2.moe.shared_expert_intermediate_size) == (True, False, 48)
    assert q2.moe.sparse_layers == (1,)  # decoder_sparse_step=2
    engine = Engine(EngineConfig(moe_checkpoints["qwen3_moe"], num_kv_blocks=16))
    kinds = [type(layer.mlp).__name__ for layer in engine.model.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]


def test_bad_moe_configs_are_clear_errors(moe_checkpoints, tmp_path):
    src = moe_checkpoints["qwen3_moe"]
    cfg = json.loads((src / "config.json").read_text())
    for key, value, match in [("num_experts_per_tok", 9, "num_experts_per_tok 9"),
                              ("moe_intermediate_size", None, "malformed")]:
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelError, match=match):
            ModelConfig.from_dir(bad)
    with pytest.raises(ModelError, match="moe_intermediate_size 32"):
        ModelConfig.from_dir(src).check_tp(3)


# -- the router and the grouped experts ------------------------------------------------


def test_router_normalises_as_each_family_does():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 2.5]])
    probs = logits.softmax(-1)
    ids, w = TopKRouter(2, renormalize=False)(logits, torch.float32)
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(w, probs.gather(1, ids))  # Qwen2-MoE default: raw softmax mass
    _, w = TopKRouter(2, renormalize=True)(logits, torch.float32)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))  # Mixtral / Qwen3-MoE: renormalised
    torch.testing.assert_close(w, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True))


def test_grouped_experts_run_only_the_selected_experts():
    """Unselected experts hold NaN weights: any compute over all experts (even masked by zero
    routing weights) would poison the output; the grouped path never reads them."""
    g = torch.Generator().manual_seed(0)
    E, H, inter, T, k = 64, 16, 8, 5, 2
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / 4
    w2 = torch.randn(E, H, inter, generator=g) / 3
    ids = torch.tensor([[3, 40], [40, 7], [3, 63], [0, 7], [63, 40]])
    weights = torch.rand(T, k, generator=g)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            expected[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    unused = torch.ones(E, dtype=torch.bool)
    unused[ids.unique()] = False
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    layer = SimpleNamespace(w13=w13, w2=w2, inter=inter, release_stacked_weights=lambda: None)
    experts = GroupedExperts()
    experts.prepare(layer)  # on CPU: the experts pre-packed for oneDNN
    assert experts.linear is not torch.nn.functional.linear or not torch.backends.mkldnn.is_available()
    out = experts.forward(x, ids, weights)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# -- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_prefill_and_each_decode_step(moe_checkpoints, family):
    assert_logits_match_transformers(moe_checkpoints[family], family)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_reference(request, moe_checkpoints):
    path = moe_checkpoints[request.param]
    ref = hf_model(path)
    prompts = prompts_of([3, 17, 40, 64, 9, 100], ref.config.vocab_size, seed=2)
    return path, prompts, [hf_greedy(ref, p, 24) for p in prompts]


def test_greedy_batch_matches_transformers_generate(moe_reference):
    path, prompts, expected = moe_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256))
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected


def test_chunked_prefill_is_token_identical(moe_reference):
    path, prompts, expected = moe_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256, max_num_batched_tokens=16))
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.num_steps > 24 + 100 // 16  # the 100-token prompt took several chunks


def test_preemption_under_a_small_pool_is_token_identical(moe_reference):
    path, prompts, expected = moe_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=40, block_size=4))
    seqs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.pool.num_used == 0


def test_prefix_cache_hit_is_token_identical(moe_reference):
    path, prompts, expected = moe_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256, block_size=8))
    (first,) = engine.generate([prompts[5]], GREEDY)
    (second,) = engine.generate([prompts[5]], GREEDY)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 96)
    assert first.output_token_ids == second.output_token_ids == expected[5]


def test_tiny_moe_checkpoint_matches_transformers(tmp_path):
    """``mesh model tiny --size moe``: a Qwen3-MoE transformers loads, with the tiny tokenizer."""
    path = write_tiny_model(tmp_path / "moe", size="moe")
    assert (path / "tokenizer.json").is_file() and "chat_template" in (path / "tokenizer_config.json").read_text()
    mc = ModelConfig.from_dir(path)
    assert (mc.family, mc.moe.num_experts, mc.moe.top_k) == ("qwen3_moe", 8, 2)
    ref = hf_model(path)
    prompts = prompts_of([6, 30], 4096, seed=5)
    expected = [hf_greedy(ref, p, 16) for p in prompts]
    seqs = Engine(EngineConfig(path, num_kv_blocks=64)).generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [s.output_token_ids for s in seqs] == expected


def test_stacked_expert_layout_loads_the_same_model(moe_checkpoints, tmp_path, monkeypatch):
    """Checkpoints that store experts pre-stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]) load into the same weights as per-expert tensors."""
    src = moe_checkpoints["qwen3_moe"]
    tensors = load_file(str(src / "model.safetensors"))
    mc = ModelConfig.from_dir(src)
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in mc.moe.sparse_layers:
        p = f"model.layers.{i}.mlp.experts."
        n = mc.moe.num_experts
        gate = torch.stack([tensors[f"{p}{e}.gate_proj.weight"] for e in range(n)])
        up = torch.stack([tensors[f"{p}{e}.up_proj.weight"] for e in range(n)])
        stacked[f"{p}gate_up_proj"] = torch.cat([gate, up], dim=1)
        stacked[f"{p}down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(n)])
    out = tmp_path / "stacked"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    save_file(stacked, str(out / "model.safetensors"))
    monkeypatch.setattr(loader, "use_default_experts", lambda *args: None)  # keep the stacked weights to compare
    a = Engine(EngineConfig(src, num_kv_blocks=16)).model
    b = Engine(EngineConfig(out, num_kv_blocks=16)).model
    for i in mc.moe.sparse_layers:
        assert torch.equal(a.layers[i].mlp.w13, b.layers[i].mlp.w13)
        assert torch.equal(a.layers[i].mlp.w2, b.layers[i].mlp.w2)
    # and a checkpoint missing one expert is refused, naming the parameter
    del stacked[f"model.layers.{mc.moe.sparse_layers[0]}.mlp.experts.down_proj"]
    save_file(stacked, str(out / "model.safetensors"))
    with pytest.raises(ModelError, match=r"missing weights for layers\.0\.mlp\.w2"):
        Engine(EngineConfig(out, num_kv_blocks=16))


# -- tensor parallel -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tp2_is_token_identical_to_tp1(moe_checkpoints, family):
    """Each expert's intermediate dimension (and the shared expert's) split over two ranks."""
    path = moe_checkpoints[family]
    prompts = prompts_of([5, 33, 64], 512, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out1, _, logits1 = run_with_logits(Engine(EngineConfig(path, num_kv_blocks=64)), prompts, params)
    two = Engine(EngineConfig(path, num_kv_blocks=64, tp=2))
    try:
        moe = next(layer.mlp for layer in two.model.layers if isinstance(layer.mlp, SparseMoE))
        assert moe.inter == 16  # half of each expert's 32 columns
        out2, _, logits2 = run_with_logits(two, prompts, params)
    finally:
        two.close()
    assert out1 == out2
    for a, b in zip(logits1, logits2, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_lora_on_a_moe_model_matches_transformers_with_peft(moe_checkpoints, tmp_path):
    """An attention adapter on a MoE model, batched with the base model, against transformers +
    peft; an adapter on the experts (peft turns MLP targets of a MoE into ``target_parameters``)
    is refused in one line naming its config."""
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model

    path = moe_checkpoints["qwen3_moe"]
    for name, targets in [("attn", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                          ("experts", ["q_proj", "gate_proj", "up_proj", "down_proj"])]:
        torch.manual_seed(7)
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=32, target_modules=targets, init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(tmp_path / name)
    prompts = prompts_of([6, 40], 512, seed=4)
    ref = PeftModel.from_pretrained(hf_model(path), tmp_path / "attn").eval()
    expected = [hf_greedy(ref, p, 12) for p in prompts]
    base = [hf_greedy(hf_model(path), p, 12) for p in prompts]
    assert expected != base
    engine = Engine(EngineConfig(path, num_kv_blocks=64, loras=(("attn", str(tmp_path / "attn")),)))
    assert {group for _, group in engine.lora.get("attn").weights} == {"qkv", "o"}
    seqs = engine.generate(prompts * 2, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           lora=["attn", "attn", None, None])
    assert [s.output_token_ids for s in seqs] == expected + base
    with pytest.raises(ModelError, match=r"experts/adapter_config.json: LoRA on parameters \(expert weights\)"):
        engine.load_lora("experts", str(tmp_path / "experts"))
