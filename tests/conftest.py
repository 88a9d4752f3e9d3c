"""Shared fixtures: the tiny model, HF reference checkpoints."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


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
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if not tie else 1.0))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 12 / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {f: make_hf_checkpoint(f, root / f) for f in HF_FAMILIES}
    out["llama_tied"] = make_hf_checkpoint("llama", root / "llama_tied", tie=True)
    return out
