"""``mesh model tiny DIR``: a random-weight Llama (or Qwen3-MoE) checkpoint with a real tokenizer.

The embedded default and the model of the test suite. Weights come from a
fixed seed, so every machine writes the same bytes. They are scaled so that
each layer changes the residual stream (outputs depend on the whole context,
which is what the KV paths are tested on) and the logits are peaked (greedy
choices are not knife-edge ties that float noise could flip).

``--size moe`` and ``small-moe`` write a ``Qwen3MoeForCausalLM`` instead (q/k norms, every
MLP a mixture of experts), with the same tokenizer and chat template (Qwen2.5's: it renders tools); ``small-moe`` runs as
many MLP columns per token as ``small`` (top-2 of 8 experts of half its width). ``deepseek`` and
``deepseek-yarn`` write a ``DeepseekV3ForCausalLM`` (``engine.tiny_deepseek``).

``fp8``: the same weights in DeepSeek's FP8 format (``engine.fp8``): the attention and MLP
projections block-quantized to e4m3 with a float32 ``weight_scale_inv`` per block, in blocks
that divide the model's dimensions (``FP8_BLOCKS``; DeepSeek's own are 128x128).
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.fp8 import is_quantized_name, quantize, scale_name
from engine.tiny_deepseek import DEEPSEEK_SIZES, deepseek_checkpoint

SIZES = {
    # ~0.2M params: the test model
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # ~52M params: the benchmark model
    "small": dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=10,
                  num_attention_heads=10, num_key_value_heads=5, tie_word_embeddings=False),
    # ~0.7M params, Qwen3-MoE: top-2 of 8 experts
    "moe": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    # ~160M params (~52M active per token), Qwen3-MoE: the MoE benchmark model
    "small-moe": dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=10,
                      num_attention_heads=10, num_key_value_heads=5, tie_word_embeddings=False,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=896),
}

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
}

FP8_BLOCKS = {"small": (128, 128), "small-moe": (128, 128)}  # the others: 16x16
VOCAB_SIZE = 4096
EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>
MAX_POSITIONS = 16384
_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "add_bos_token": False,
    "model_max_length": MAX_POSITIONS,
}


ALL_SIZES = (*SIZES, *DEEPSEEK_SIZES)


def write_tiny_model(out: str | Path, size: str = "tiny", seed: int = 0, fp8: bool = False, **overrides) -> Path:
    """``overrides``: config keys of a Llama-family size to change (``num_hidden_layers=5``:
    pipeline stages that do not divide the layers evenly; heads that tensor parallelism divides)."""
    if size not in ALL_SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(ALL_SIZES)})")
    out = Path(out)
    if size in DEEPSEEK_SIZES:
        if overrides:
            raise ValueError(f"--size {size} takes no config overrides")
        config, weights = deepseek_checkpoint(size, seed, VOCAB_SIZE, MAX_POSITIONS, EOS_IDS)
    else:
        config = _llama_config(size, overrides)
        weights = _random_weights(config, seed)
    if fp8:
        block = FP8_BLOCKS.get(size, (16, 16))
        weights = quantize_checkpoint(weights, block)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                         "activation_scheme": "dynamic"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_IDS}, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def quantize_checkpoint(weights: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The weights in DeepSeek's FP8 format: each projection e4m3 with its ``weight_scale_inv``."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if is_quantized_name(name) and w.dim() == 2:
            out[name], out[scale_name(name)] = quantize(w, block)
        else:
            out[name] = w
    return out


def _llama_config(size: str, overrides: dict) -> dict:
    shape = SIZES[size] | overrides
    moe = "num_experts" in shape
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": EOS_IDS,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        **shape,
    }
    if moe:
        config |= QWEN3_MOE | {"head_dim": shape["hidden_size"] // shape["num_attention_heads"]}
    return config


def write_tokenizer(out: Path) -> bool:
    """Write the tiny model's tokenizer and chat template into ``out``; False when they were there
    already. A default model written by an older pdmesh gets the current template this way."""
    files = {"tokenizer.json": _asset("tokenizer.json"),
             "tokenizer_config.json": (json.dumps(_TOKENIZER_CONFIG | {
                 # Qwen2.5's template (its default system line made neutral): it renders tools, and
                 # the gateway reads Hermes tool calls (<tool_call>...</tool_call>) from the output.
                 "chat_template": _asset("chat_template.jinja").decode()}, indent=2) + "\n").encode()}
    stale = [name for name, data in files.items()
             if not (out / name).is_file() or (out / name).read_bytes() != data]
    for name in stale:
        (out / name).write_bytes(files[name])
    return bool(stale)


def _asset(name: str) -> bytes:
    return (resources.files("engine.assets") / name).read_bytes()


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = h // heads

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    # Small embeddings: the normalized sublayers dominate the residual stream, so the
    # next token depends on the context, not just on the last token.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.2}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, heads * head_dim)
        if "num_experts" in cfg:
            w |= _moe_weights(p, cfg, linear)
        else:
            w[p + "mlp.gate_proj.weight"] = linear(inter, h)
            w[p + "mlp.up_proj.weight"] = linear(inter, h)
            w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = torch.ones(h)
    if not cfg["tie_word_embeddings"]:
        # logits with a std of ~12: peaked, like a trained model's
        w["lm_head.weight"] = torch.randn(vocab, h, generator=g) * (12 / math.sqrt(h))
    return {k: v.contiguous() for k, v in w.items()}


def _moe_weights(p: str, cfg: dict, linear) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE layer's q/k norms, router and experts (one tensor per expert and projection,
    the layout Hugging Face checkpoints ship)."""
    h, inter, head_dim = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["head_dim"]
    w = {p + "self_attn.q_norm.weight": torch.ones(head_dim), p + "self_attn.k_norm.weight": torch.ones(head_dim),
         # router logits with a std of ~2: tokens spread over the experts, each with a clear top 2
         p + "mlp.gate.weight": linear(cfg["num_experts"], h) * 2}
    for e in range(cfg["num_experts"]):
        q = f"{p}mlp.experts.{e}."
        w[q + "gate_proj.weight"] = linear(inter, h)
        w[q + "up_proj.weight"] = linear(inter, h)
        w[q + "down_proj.weight"] = linear(h, inter)
    return w
