"""``mesh model tiny DIR --size deepseek|deepseek-yarn``: a tiny random-weight DeepSeek-V3.

Made with transformers' own ``DeepseekV3ForCausalLM`` (its ``save_pretrained`` writes the
layout DeepSeek's checkpoints have: one tensor per expert and projection,
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts``), with weights drawn from a seeded
generator and scaled as ``engine.tiny``'s are: peaked logits that depend on the context, and
routers with a clear choice. Three decoder layers, the first dense; 8 routed experts in 2
groups (1 kept per token), top-2, 2 shared experts.

    deepseek       q_lora_rank 48 (q_a_proj, q_a_layernorm, q_b_proj), interleaved rope
    deepseek-yarn  q_lora_rank null (a plain q_proj), YaRN scaling with DeepSeek's
                   mscale/mscale_all_dim (unequal, so both corrections show), rope not interleaved

One multi-token-prediction layer (``num_nextn_predict_layers`` 1) follows the last decoder
layer in DeepSeek's published naming (``model.layers.3.{enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head, embed_tokens}`` and a decoder block): transformers does
not save one, so it is written here, from a fourth layer transformers built.

transformers is a test dependency, not a serving one: without it these sizes are refused.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from mesh.errors import ModelError

LAYERS = 3
COMMON = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
    n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_nextn_predict_layers=1,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
)
DEEPSEEK_SIZES = {
    "deepseek": dict(q_lora_rank=48, rope_interleave=True),
    "deepseek-yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
}


def deepseek_checkpoint(size: str, seed: int, vocab: int, max_positions: int, eos: list[int]
                        ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, the weights by checkpoint name) of a tiny DeepSeek-V3."""
    try:
        import transformers as tf
    except ImportError:
        raise ModelError(f"--size {size} is made with transformers: pip install transformers") from None
    cfg = tf.DeepseekV3Config(**COMMON, **DEEPSEEK_SIZES[size], vocab_size=vocab, num_hidden_layers=LAYERS + 1,
                              max_position_embeddings=max_positions, eos_token_id=eos, pad_token_id=0,
                              bos_token_id=None)
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    _draw_weights(model, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
        weights = load_file(str(Path(tmp) / "model.safetensors"))
    # the fourth layer transformers built is the MTP layer's decoder block; the rest of that layer
    config["num_hidden_layers"] = LAYERS
    config["dtype"] = "float32"
    weights |= _mtp_extras(weights, seed + 1)
    return config, weights


def _draw_weights(model, seed: int) -> None:
    """Every weight from one seeded generator, in name order, scaled as ``engine.tiny`` scales its
    own: embeddings small, logits peaked, routers with a clear top-k, norms near one."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            p = tensors[name]
            if not p.is_floating_point() or name.endswith(("inv_freq", "original_inv_freq")):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):  # big enough to change some choices
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 12 / math.sqrt(p.shape[-1]))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 2 / math.sqrt(p.shape[-1]))
            else:  # stacked experts are [E, out, in]: the fan-in is the last dimension
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _mtp_extras(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer's own tensors in DeepSeek-V3's naming (its embedding and head are copies
    of the model's, as DeepSeek ships them)."""
    g = torch.Generator().manual_seed(seed)
    h = weights["model.norm.weight"].shape[0]
    p = f"model.layers.{LAYERS}."
    return {
        p + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        p + "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        p + "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / math.sqrt(2 * h),
        p + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        p + "shared_head.head.weight": weights["lm_head.weight"].clone(),
    }
