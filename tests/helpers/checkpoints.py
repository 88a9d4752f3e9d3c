"""Small random Hugging Face checkpoints, with weights scaled for peaked, context-dependent logits;
an FP8 checkpoint dequantized block by block (transformers' reference for it)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def peak_weights(model, seed: int, embed_scale: float) -> None:
    """Overwrite every parameter of ``model`` so that greedy choices are clear and depend on context."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * embed_scale)
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 12 / math.sqrt(p.shape[-1]))
            elif name.endswith("mlp.gate.weight"):  # a MoE router: a clear top-k per token
                p.copy_(torch.randn(p.shape, generator=g) * 2 / math.sqrt(p.shape[-1]))
            else:  # stacked experts are [E, out, in]: the fan-in is the last dimension
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def make_hf_checkpoint(family: str, out: Path, tie: bool = False, seed: int = 0) -> Path:
    """A small random HF checkpoint of ``family``, with weights scaled for peaked, context-dependent logits."""
    import transformers as tf

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=tie, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        }, rope_theta=50000.0)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)  # head_dim != hidden / heads
        cls = tf.Qwen3ForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    peak_weights(model, seed, embed_scale=0.2 if not tie else 1.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_moe_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """A small random HF MoE checkpoint with peaked, context-dependent logits and routers that
    spread tokens over the experts.

    qwen3_moe: 3 layers, the middle one dense (``mlp_only_layers``), qk norms, head_dim 32;
    mixtral: every layer sparse, always renormalised top-2;
    qwen2_moe: ``decoder_sparse_step`` 2 (layer 0 dense, 1 sparse), q/k/v biases, a gated shared
    expert, top-k weights not renormalised."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=32, intermediate_size=96,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[1])
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=32, num_local_experts=6,
                               num_experts_per_tok=2, sliding_window=None)
        cls = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=False, decoder_sparse_step=2)
        cls = tf.Qwen2MoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    peak_weights(model, seed, embed_scale=0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


# -- FP8 checkpoints (DeepSeek's block-scaled format) ------------------------------------------


def dequantized_by_loops(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: every block times its own scale, one block at a time (edge blocks partial)."""
    out = q.float().clone()
    bn, bk = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale_inv[i, j]
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src``'s FP8 checkpoint with every FP8 weight dequantized (by the loops above) to float32, the
    scales dropped and the quantization_config gone: what transformers runs as the reference."""
    from safetensors.torch import load_file, save_file

    from engine.fp8 import FP8_DTYPE

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    plain = {name: (dequantized_by_loops(t, tensors[name + "_scale_inv"], block) if t.dtype == FP8_DTYPE else t)
             for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_file(plain, str(dst / "model.safetensors"))
    return dst
