"""FlashInfer's fused MoE kernel against the grouped experts (the CPU path), on CUDA.

Layer level: one ``SparseMoE`` with random weights; the fused backend (bf16/fp16) against the
grouped backend run in float32 on the same weights and routing. Engine level: the tiny MoE
checkpoint (``mesh model tiny --size moe``) whose MoE layers pick the fused kernel by default
on CUDA in bf16, against the same engine on the grouped experts, both measured against a
float32 engine (the yardstick: the fused engine may not be much further off than the grouped
one in the same dtype).

Skips cleanly (collected, reported as skipped) without CUDA or flashinfer.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

import engine.loader as loader
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.moe import FlashInferExperts, GroupedExperts, SparseMoE
from engine.sampling import SamplingParams
from engine.tiny import write_tiny_model
from engine.tp import Shard

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def moe_layer(tmp_path, hidden=256, inter=256, experts=8, top_k=2) -> SparseMoE:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": hidden,
           "intermediate_size": 512, "moe_intermediate_size": inter, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": experts,
           "num_experts_per_tok": top_k, "norm_topk_prob": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    layer = SparseMoE(ModelConfig.from_dir(tmp_path), Shard())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer.eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fused_layer_matches_grouped(tmp_path, dtype, tokens):
    layer = moe_layer(tmp_path)
    x = torch.randn(tokens, layer.gate.in_features, generator=torch.Generator().manual_seed(tokens))
    grouped = copy.deepcopy(layer).to(CUDA, torch.float32)
    grouped.use(GroupedExperts())
    reference = grouped(x.to(CUDA))  # grouped, float32
    fused = layer.to(CUDA, dtype)
    fused.use(FlashInferExperts())
    out = fused(x.to(CUDA, dtype)).float()
    assert out.shape == reference.shape
    err = (out - reference).abs().max().item()
    assert err < TOL[dtype] * reference.abs().max().item(), f"fused MoE off by {err}"


def test_engine_on_the_fused_kernel_stays_as_close_as_the_grouped_one(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path / "moe", size="moe")
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 4096) for _ in range(n)] for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", attention_backend="torch", num_kv_blocks=64)  # head_dim 16: no FlashInfer attention

    def logits(engine):
        engine.runner.capture_logits = True
        engine.generate(prompts, params)
        return engine.runner.last_logits.float()

    fused = Engine(EngineConfig(path, dtype="bfloat16", **kw))
    assert all(layer.mlp.experts.name == "flashinfer" for layer in fused.model.layers)
    fused_logits = logits(fused)
    del fused
    reference = logits(Engine(EngineConfig(path, dtype="float32", **kw)))
    monkeypatch.setattr(loader, "default_experts", lambda device, dtype: GroupedExperts())
    grouped = Engine(EngineConfig(path, dtype="bfloat16", **kw))
    assert all(layer.mlp.experts.name == "grouped" for layer in grouped.model.layers)
    grouped_err = (logits(grouped) - reference).abs().max().item()
    fused_err = (fused_logits - reference).abs().max().item()
    assert fused_err <= 2 * grouped_err + 0.05, (fused_err, grouped_err)
