"""DeepSeek-V3 (multi-head latent attention, DeepSeekMoE) in the engine, against Hugging Face
transformers: the tiny checkpoints ``mesh model tiny --size deepseek|deepseek-yarn`` write,
the router against transformers' own gate, and what is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.mla import LatentAttention
from engine.moe import GroupedTopKRouter, SparseMoE
from engine.sampling import SamplingParams
from kvstore.cache import KVCacheSpec
from mesh.errors import ModelError
from tests.helpers.references import (
    assert_logits_match_transformers,
    hf_greedy,
    hf_model,
    prompts_of,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SIZES = ["deepseek", "deepseek-yarn"]


# -- configuration and checkpoint ------------------------------------------------------


def test_configs_read_mla_moe_and_yarn(deepseek_models):
    ds = ModelConfig.from_dir(deepseek_models["deepseek"])
    assert ds.family == "deepseek_v3"
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_nope_head_dim, ds.mla.qk_rope_head_dim,
            ds.mla.v_head_dim, ds.mla.rope_interleave) == (48, 32, 32, 16, 24, True)
    assert ds.head_dim == 16 and ds.num_kv_heads == 1  # the rope dims; one latent vector per token
    moe = ds.moe
    assert moe.sparse_layers == (1, 2)  # first_k_dense_replace 1
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (8, 2, 2, 1)
    assert (moe.router, moe.routed_scaling_factor, moe.norm_topk_prob) == ("sigmoid-grouped", 2.5, True)
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gated) == (2 * 32, False)
    assert ds.attention_scale == pytest.approx((32 + 16) ** -0.5)
    yarn = ModelConfig.from_dir(deepseek_models["deepseek-yarn"])
    assert yarn.mla.q_lora_rank is None and not yarn.mla.rope_interleave
    assert (yarn.rope.kind, yarn.rope.factor, yarn.rope.original_max_position) == ("yarn", 16.0, 1024)
    m_all = 0.1 * 0.707 * torch.log(torch.tensor(16.0)).item() + 1
    assert yarn.rope.attention_factor == pytest.approx((0.1 * torch.log(torch.tensor(16.0)).item() + 1) / m_all)
    assert yarn.attention_scale == pytest.approx((32 + 16) ** -0.5 * m_all**2)


def test_the_checkpoint_has_deepseeks_layout_and_an_mtp_layer_the_engine_skips(deepseek_models):
    path = deepseek_models["deepseek"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names  # one tensor per expert
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the first layer dense
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (3, 1)
    mtp = {n for n in names if n.startswith("model.layers.3.")}  # after the last decoder layer
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
            "model.layers.3.shared_head.head.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.self_attn.kv_b_proj.weight"} <= mtp
    engine = Engine(EngineConfig(path, num_kv_blocks=16))
    assert len(engine.model.layers) == 3
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in engine.model.layers)
    assert [type(layer.mlp).__name__ for layer in engine.model.layers] == ["MLP", "SparseMoE", "SparseMoE"]


def test_the_cache_holds_one_latent_vector_per_token_and_layer(deepseek_models):
    engine = Engine(EngineConfig(deepseek_models["deepseek"], num_kv_blocks=16, block_size=8))
    spec = engine.kv_spec
    assert (spec.num_planes, spec.num_kv_heads, spec.head_dim) == (1, 1, 32 + 16)
    assert spec.block_bytes == 3 * 8 * (32 + 16) * 4  # layers x tokens x (latent + rope) x fp32
    # at the published shapes, bf16: DeepSeek-V3 (61 layers, 512 + 64) against Llama-3-70B (80 x 8 heads x 128, K and V)
    v3 = KVCacheSpec(61, 1, 1, 1, 512 + 64, torch.bfloat16, num_planes=1)
    llama70 = KVCacheSpec(80, 1, 1, 8, 128, torch.bfloat16)
    assert (v3.block_bytes, llama70.block_bytes) == (70272, 327680)
    assert llama70.block_bytes / v3.block_bytes > 4.6


# -- against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_logits_match_transformers_prefill_and_each_decode_step(deepseek_models, size):
    assert_logits_match_transformers(deepseek_models[size], size)


@pytest.fixture(scope="module", params=SIZES)
def deepseek_reference(request, deepseek_models):
    path = deepseek_models[request.param]
    ref = hf_model(path)
    prompts = prompts_of([3, 17, 40, 64, 9, 100], ref.config.vocab_size, seed=2)
    return path, prompts, [hf_greedy(ref, p, 24) for p in prompts]


def test_greedy_batch_matches_transformers_generate(deepseek_reference):
    path, prompts, expected = deepseek_reference
    seqs = Engine(EngineConfig(path, num_kv_blocks=256)).generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected


def test_chunked_prefill_is_token_identical(deepseek_reference):
    path, prompts, expected = deepseek_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256, max_num_batched_tokens=16))
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.num_steps > 24 + 100 // 16  # the 100-token prompt took several chunks


def test_preemption_under_a_small_pool_is_token_identical(deepseek_reference):
    path, prompts, expected = deepseek_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=40, block_size=4))
    seqs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.pool.num_used == 0


def test_prefix_cache_hit_is_token_identical(deepseek_reference):
    path, prompts, expected = deepseek_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256, block_size=8))
    (first,) = engine.generate([prompts[5]], GREEDY)
    (second,) = engine.generate([prompts[5]], GREEDY)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 96)
    assert first.output_token_ids == second.output_token_ids == expected[5]
    shared = [*prompts[5][:50], 7, 8, 9]  # a prompt sharing a prefix reuses its full blocks
    (third,) = engine.generate([shared], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert third.num_cached_tokens == 48


def test_ngram_speculation_is_token_identical(deepseek_models):
    """Verification rows (the last token and its drafts) attend over the latent cache as decode does."""
    path = deepseek_models["deepseek"]
    ref = hf_model(path)
    repeated = [p * 3 for p in prompts_of([12, 20, 7], ref.config.vocab_size, seed=4)]  # repeats to draft from
    engine = Engine(EngineConfig(path, num_kv_blocks=256, speculative="ngram", num_speculative_tokens=3))
    seqs = engine.generate(repeated, GREEDY)
    assert [s.output_token_ids for s in seqs] == [hf_greedy(ref, p, 24) for p in repeated]
    assert engine.scheduler.spec.drafted > 0


def test_yarn_on_a_llama_checkpoint_matches_transformers(hf_checkpoints, tmp_path):
    """YaRN is the rope's, not DeepSeek's: a Llama with it (cos/sin scaled by its attention
    factor; no mscale_all_dim, so the softmax scale stays 1/sqrt(head_dim))."""
    path = tmp_path / "llama-yarn"
    shutil.copytree(hf_checkpoints["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                              "original_max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_dir(path)
    assert mc.rope.kind == "yarn" and mc.rope.attention_factor > 1 and mc.attention_scale == mc.head_dim**-0.5
    assert_logits_match_transformers(path, "llama-yarn")


# -- the router ----------------------------------------------------------------------------


def _hf_router(experts=16, top_k=4, groups=4, topk_groups=2, norm=True, scaling=2.5, hidden=32, seed=0):
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
                              n_group=groups, topk_group=topk_groups, norm_topk_prob=norm,
                              routed_scaling_factor=scaling)
    g = torch.Generator().manual_seed(seed)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(experts, hidden, generator=g))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=g))
    ours = GroupedTopKRouter(experts, top_k, groups, topk_groups, norm, scaling)
    with torch.no_grad():
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    return hf, ours, torch.randn(64, hidden, generator=g)


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_router_matches_transformers_gate(norm):
    hf, ours, x = _hf_router(norm=norm)
    logits, hf_w, hf_ids = hf(x)
    ids, w = ours(logits, torch.float32)
    order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order))
    groups = ids // 4  # 16 experts in 4 groups: every token's experts come from at most 2 groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_the_bias_chooses_experts_but_does_not_weight_them():
    router = GroupedTopKRouter(8, 2, 2, 1, renormalize=False, scaling=1.0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 2.5, -1.0, -2.0, -3.0]])
    ids, w = router(logits, torch.float32)
    assert sorted(ids[0].tolist()) == [0, 1]  # group 0 (best two: 3 + 2) beats group 1 (2.5 - 1)
    with torch.no_grad():
        router.e_score_correction_bias[5] = 5.0  # now group 1 wins, and expert 5 in it
    ids, w = router(logits, torch.float32)
    assert sorted(ids[0].tolist()) == [4, 5]
    weights = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
    assert weights[5] == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())  # unbiased score


def test_router_logits_stay_fp32_in_a_bf16_model(deepseek_models):
    engine = Engine(EngineConfig(deepseek_models["deepseek"], num_kv_blocks=16, dtype="bfloat16"))
    moe = next(layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoE))
    assert moe.router.e_score_correction_bias.dtype == torch.float32 and moe.router_dtype == torch.float32
    assert engine.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    (seq,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(seq.output_token_ids) == 4


# -- refused in one line ---------------------------------------------------------------------


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.mark.parametrize(("change", "match"), [
    ({"kv_lora_rank": 24}, r"kv_a_layernorm.weight has shape \(32,\), expected \(24\) from config.json's "
                           r"kv_lora_rank 24$"),
    ({"qk_rope_head_dim": 8}, r"kv_a_proj_with_mqa.weight has shape \(48, 64\), expected \(40, 64\) from "
                              r"config.json's kv_lora_rank 32 \+ qk_rope_head_dim 8"),
    ({"v_head_dim": 16}, r"kv_b_proj.weight has shape \(224, 32\), expected \(192, 32\) from config.json's "
                         r"num_attention_heads 4 x \(qk_nope_head_dim 32 \+ v_head_dim 16\)"),
    ({"q_lora_rank": None}, r"missing weights for layers.0.self_attn.q_proj.weight"),
])
def test_mla_dimensions_that_disagree_with_the_tensors_are_one_line_errors(deepseek_models, tmp_path, change, match):
    bad = _edited(deepseek_models["deepseek"], tmp_path / "bad", **change)
    with pytest.raises(ModelError, match=match) as e:
        Engine(EngineConfig(bad, num_kv_blocks=16))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("change", "match"), [
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
    ({"topk_group": 3}, "topk_group 3 of n_group 2"),
    ({"scoring_func": "softmax"}, "unsupported DeepSeek routing"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim 15 must be even"),
])
def test_bad_deepseek_configs_are_clear_errors(deepseek_models, tmp_path, change, match):
    with pytest.raises(ModelError, match=match):
        ModelConfig.from_dir(_edited(deepseek_models["deepseek"], tmp_path / "bad", **change))


@pytest.mark.parametrize(("fields", "match"), [
    ({"tp": 2}, "--tp 2 is not supported for MLA models"),
    ({"loras": (("a", "/nowhere"),)}, "LoRA adapters are not supported on MLA models"),
    ({"speculative": "eagle3:/nowhere"}, "--speculative eagle3 is not supported on MLA models"),
    ({"attention_backend": "flashinfer-ragged"}, "does not serve latent \\(MLA\\) caches"),
])
def test_what_mla_does_not_run_yet_is_refused_at_start(deepseek_models, fields, match):
    with pytest.raises((ValueError, ModelError), match=match):
        Engine(EngineConfig(deepseek_models["deepseek"], num_kv_blocks=16, **fields))


def test_mesh_generate_runs_the_tiny_deepseek(deepseek_models):
    out = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(deepseek_models["deepseek-yarn"]),
                          "--max-tokens", "6", "--ignore-eos", "--json", "Hello there"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(line["token_ids"]) == 6 and line["finish_reason"] == "length"
