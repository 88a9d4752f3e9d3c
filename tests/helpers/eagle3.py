"""A random EAGLE-3 checkpoint for a target, in the published format (``LlamaForCausalLMEagle3``:
config.json and model.safetensors with the EAGLE authors' tensor names, as vLLM and SGLang load
them; see engine/eagle3.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_eagle3_checkpoint(target: Path, out: Path, *, seed: int = 0, hidden_size: int | None = None,
                           draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                           with_embeddings: bool = False, **overrides) -> Path:
    """An EAGLE-3 head for the model in ``target`` with random weights. ``draft_vocab_size``: a
    draft vocabulary of that many target ids (every ``vocab // draft``-th, through ``d2t``/``t2d``);
    ``aux_layers``: written as ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the checkpoint's
    default otherwise); ``overrides``: config.json fields set as given (to write a bad one)."""
    tcfg = json.loads((target / "config.json").read_text())
    vocab, target_hidden = tcfg["vocab_size"], tcfg["hidden_size"]
    hidden = hidden_size or target_hidden
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = hidden // heads
    inter = 2 * hidden
    draft_vocab = draft_vocab_size or vocab
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden, "target_hidden_size": target_hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6), "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096), "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if tcfg.get("rope_scaling"):
        config["rope_scaling"] = tcfg["rope_scaling"]
    if aux_layers is not None:
        config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux_layers}
    config.update(overrides)
    g = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    weights = {
        "fc.weight": linear(hidden, 3 * config["target_hidden_size"]),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": linear(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": linear(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.mlp.gate_proj.weight": linear(inter, hidden),
        "midlayer.mlp.up_proj.weight": linear(inter, hidden),
        "midlayer.mlp.down_proj.weight": linear(hidden, inter),
        "norm.weight": norm(hidden),
        "lm_head.weight": linear(draft_vocab, hidden) * 8,
    }
    kept = torch.arange(draft_vocab) * (vocab // draft_vocab)  # the target ids of the draft vocabulary
    weights["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    weights["t2d"] = t2d
    if with_embeddings or hidden != target_hidden:
        weights["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
