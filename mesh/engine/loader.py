"""Load a Hugging Face Llama-family checkpoint into ``CausalLM``.

Weights are streamed tensor by tensor from ``*.safetensors`` straight onto the
target device; the fused QKV and gate/up parameters are filled slice by slice.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from mesh.engine.config import ModelConfig
from mesh.engine.errors import ModelError
from mesh.engine.model import CausalLM, Rotary

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _targets(model: CausalLM, cfg: ModelConfig, name: str) -> tuple[torch.Tensor, int, int] | None:
    """Where an HF tensor goes: (parameter, row offset, row count); None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, 0, cfg.vocab_size
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings:
            return None
        return model.lm_head.weight, 0, cfg.vocab_size
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        return None
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = attn.q_size, attn.kv_size
    inter = cfg.intermediate_size
    table = {
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, cfg.hidden_size),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0, cfg.hidden_size),
        "self_attn.q_proj.weight": (attn.qkv_proj.weight, 0, q),
        "self_attn.k_proj.weight": (attn.qkv_proj.weight, q, kv),
        "self_attn.v_proj.weight": (attn.qkv_proj.weight, q + kv, kv),
        "self_attn.o_proj.weight": (attn.o_proj.weight, 0, cfg.hidden_size),
        "mlp.gate_proj.weight": (mlp.gate_up_proj.weight, 0, inter),
        "mlp.up_proj.weight": (mlp.gate_up_proj.weight, inter, inter),
        "mlp.down_proj.weight": (mlp.down_proj.weight, 0, cfg.hidden_size),
    }
    if cfg.qkv_bias:
        table |= {
            "self_attn.q_proj.bias": (attn.qkv_proj.bias, 0, q),
            "self_attn.k_proj.bias": (attn.qkv_proj.bias, q, kv),
            "self_attn.v_proj.bias": (attn.qkv_proj.bias, q + kv, kv),
        }
    if cfg.qk_norm:
        table |= {
            "self_attn.q_norm.weight": (attn.q_norm.weight, 0, cfg.head_dim),
            "self_attn.k_norm.weight": (attn.k_norm.weight, 0, cfg.head_dim),
        }
    return table.get(rest)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int) -> CausalLM:
    """An uninitialized model on ``device`` (no host-side random init of billions of weights)."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg, max_positions).to(device)
    model.eval().requires_grad_(False)
    return model


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int) -> CausalLM:
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{cfg.path} has no *.safetensors weights")
    model = build_model(cfg, device, dtype, max_positions)
    expected = _expected_rows(model, cfg)
    loaded: dict[int, int] = {}
    for file in files:
        try:
            _load_file(model, cfg, file, device, loaded)
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise ModelError(f"cannot read weights {file.name}: {e}") from None
    missing = [name for pid, (name, rows) in expected.items() if loaded.get(pid, 0) < rows]
    if missing:
        raise ModelError(f"{cfg.path} is missing weights for {', '.join(missing[:3])}")
    return model


def _load_file(model: CausalLM, cfg: ModelConfig, file: Path, device: torch.device, loaded: dict[int, int]) -> None:
    dev = str(device) if device.type == "cuda" else "cpu"
    with safe_open(str(file), framework="pt", device=dev) as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            target = _targets(model, cfg, name)
            if target is None:
                continue
            param, offset, rows = target
            tensor = f.get_tensor(name)
            if tensor.shape[0] != rows or tensor.shape[1:] != param.shape[1:]:
                raise ModelError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected ({rows}, {', '.join(map(str, param.shape[1:]))})"
                )
            with torch.no_grad():
                param[offset : offset + rows].copy_(tensor)
            loaded[id(param)] = loaded.get(id(param), 0) + rows


def _expected_rows(model: CausalLM, cfg: ModelConfig) -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        out[id(p)] = (name, p.shape[0])
    return out
