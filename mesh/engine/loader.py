"""Load a Hugging Face Llama-family checkpoint into ``CausalLM``.

Weights are streamed tensor by tensor from ``*.safetensors`` straight onto the
target device; the fused QKV and gate/up parameters are filled slice by slice.
A tensor-parallel rank reads only its shard of each sharded tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mesh.engine.config import ModelConfig
from mesh.engine.errors import ModelError
from mesh.engine.model import CausalLM, Rotary, pack_cpu_linears
from mesh.engine.tp import Shard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Target:
    """Where (this rank's share of) a checkpoint tensor goes."""

    param: torch.Tensor
    offset: int  # first row of ``param`` it fills
    shape: tuple[int, ...]  # the whole tensor's shape in the checkpoint
    take: tuple[int, int, int] | None = None  # (dim, start, count) this rank reads; None: all of it


def _targets(model: CausalLM, cfg: ModelConfig, name: str) -> _Target | None:
    """Where an HF tensor goes; None for tensors we do not use."""
    hidden, shard = cfg.hidden_size, model.shard
    if name == "model.embed_tokens.weight":
        return _Target(model.embed_tokens.weight, 0, (cfg.vocab_size, hidden))
    if name == "model.norm.weight":
        return _Target(model.norm.weight, 0, (hidden,))
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings:
            return None
        return _Target(model.lm_head.weight, 0, (cfg.vocab_size, hidden))
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        return None
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    d, q, kv = cfg.head_dim, attn.q_size, attn.kv_size
    q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
    q0, kv0 = shard.part(cfg.num_heads)[0] * d, shard.part(cfg.num_kv_heads)[0] * d
    inter, inter_all = mlp.inter, cfg.intermediate_size
    i0 = shard.part(inter_all)[0]
    # Column-parallel (qkv, gate/up): this rank's rows of each; row-parallel (o, down): its columns.
    table = {
        "input_layernorm.weight": _Target(layer.input_layernorm.weight, 0, (hidden,)),
        "post_attention_layernorm.weight": _Target(layer.post_attention_layernorm.weight, 0, (hidden,)),
        "self_attn.q_proj.weight": _Target(attn.qkv_proj.weight, 0, (q_all, hidden), (0, q0, q)),
        "self_attn.k_proj.weight": _Target(attn.qkv_proj.weight, q, (kv_all, hidden), (0, kv0, kv)),
        "self_attn.v_proj.weight": _Target(attn.qkv_proj.weight, q + kv, (kv_all, hidden), (0, kv0, kv)),
        "self_attn.o_proj.weight": _Target(attn.o_proj.weight, 0, (hidden, q_all), (1, q0, q)),
        "mlp.gate_proj.weight": _Target(mlp.gate_up_proj.weight, 0, (inter_all, hidden), (0, i0, inter)),
        "mlp.up_proj.weight": _Target(mlp.gate_up_proj.weight, inter, (inter_all, hidden), (0, i0, inter)),
        "mlp.down_proj.weight": _Target(mlp.down_proj.weight, 0, (hidden, inter_all), (1, i0, inter)),
    }
    if cfg.qkv_bias:
        table |= {
            "self_attn.q_proj.bias": _Target(attn.qkv_proj.bias, 0, (q_all,), (0, q0, q)),
            "self_attn.k_proj.bias": _Target(attn.qkv_proj.bias, q, (kv_all,), (0, kv0, kv)),
            "self_attn.v_proj.bias": _Target(attn.qkv_proj.bias, q + kv, (kv_all,), (0, kv0, kv)),
        }
    if cfg.qk_norm:  # per head, the same for every head: replicated
        table |= {
            "self_attn.q_norm.weight": _Target(attn.q_norm.weight, 0, (d,)),
            "self_attn.k_norm.weight": _Target(attn.k_norm.weight, 0, (d,)),
        }
    return table.get(rest)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                shard: Shard | None = None) -> CausalLM:
    """An uninitialized model on ``device`` (no host-side random init of billions of weights)."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, shard)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg, max_positions).to(device)
    model.eval().requires_grad_(False)
    return model


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
               shard: Shard | None = None) -> CausalLM:
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{cfg.path} has no *.safetensors weights")
    model = build_model(cfg, device, dtype, max_positions, shard)
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
    if device.type == "cpu":
        pack_cpu_linears(model)
    return model


def _load_file(model: CausalLM, cfg: ModelConfig, file: Path, device: torch.device, loaded: dict[int, int]) -> None:
    dev = str(device) if device.type == "cuda" else "cpu"
    with safe_open(str(file), framework="pt", device=dev) as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            target = _targets(model, cfg, name)
            if target is None:
                continue
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if shape != target.shape:
                raise ModelError(
                    f"weight {name} has shape {shape}, expected ({', '.join(map(str, target.shape))})"
                )
            if target.take is None:
                tensor = part[:]
            else:
                dim, start, count = target.take
                tensor = part[start : start + count] if dim == 0 else part[:, start : start + count]
            rows = tensor.shape[0]
            with torch.no_grad():
                target.param[target.offset : target.offset + rows].copy_(tensor)
            loaded[id(target.param)] = loaded.get(id(target.param), 0) + rows


def _expected_rows(model: CausalLM, cfg: ModelConfig) -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        out[id(p)] = (name, p.shape[0])
    return out
