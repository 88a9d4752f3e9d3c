"""Load a Hugging Face Llama-family checkpoint into ``CausalLM``.

Weights are streamed tensor by tensor from ``*.safetensors`` straight onto the
target device; the fused QKV and gate/up parameters, and the stacked experts of
MoE layers, are filled slice by slice. A tensor-parallel rank reads only its
shard of each sharded tensor, a pipeline stage only its layers (``ModelPart``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import CausalLM, HeldElsewhere, ModelPart, Rotary, keep_stage, pack_cpu_linears
from engine.moe import SparseMoE, default_experts
from engine.tp import Shard
from mesh.errors import ModelError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class _Target:
    """Where (this rank's share of) a checkpoint tensor goes: ``param[dst] = tensor[src]``."""

    param: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's shape in the checkpoint
    src: Index = ()  # the part this rank reads (all of it by default)
    dst: Index = ()  # where that part goes in ``param`` (all of it by default)


def _span(start: int, count: int) -> slice:
    return slice(start, start + count)


def _targets(model: CausalLM, cfg: ModelConfig, name: str) -> list[_Target]:
    """Where an HF tensor goes (several places for a fused one); empty for tensors we do not use."""
    hidden = cfg.hidden_size
    if name == "model.embed_tokens.weight":
        return [_Target(model.embed_tokens.weight, (cfg.vocab_size, hidden))] if model.embed_tokens is not None else []
    if name == "model.norm.weight":
        return [_Target(model.norm.weight, (hidden,))] if model.norm is not None else []
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings or model.lm_head is None:
            return []
        return [_Target(model.lm_head.weight, (cfg.vocab_size, hidden))]
    m = _LAYER.match(name)
    if not m:
        return []
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers or isinstance(model.layers[i], HeldElsewhere):  # another pipeline stage's
        return []
    layer = model.layers[i]
    table = _attention_table(layer, cfg, model.shard)
    mlp = layer.mlp
    table |= _moe_table(mlp, cfg, model.shard, rest) if isinstance(mlp, SparseMoE) else _mlp_table(mlp, cfg, model.shard)
    return table.get(rest, [])


def _attention_table(layer, cfg: ModelConfig, shard: Shard) -> dict[str, list[_Target]]:
    attn, hidden = layer.self_attn, cfg.hidden_size
    d, q, kv = cfg.head_dim, attn.q_size, attn.kv_size
    q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
    q0, kv0 = shard.part(cfg.num_heads)[0] * d, shard.part(cfg.num_kv_heads)[0] * d
    # Column-parallel (qkv): this rank's rows of each; row-parallel (o): its columns.
    qkv = attn.qkv_proj.weight
    table = {
        "input_layernorm.weight": [_Target(layer.input_layernorm.weight, (hidden,))],
        "post_attention_layernorm.weight": [_Target(layer.post_attention_layernorm.weight, (hidden,))],
        "self_attn.q_proj.weight": [_Target(qkv, (q_all, hidden), (_span(q0, q),), (_span(0, q),))],
        "self_attn.k_proj.weight": [_Target(qkv, (kv_all, hidden), (_span(kv0, kv),), (_span(q, kv),))],
        "self_attn.v_proj.weight": [_Target(qkv, (kv_all, hidden), (_span(kv0, kv),), (_span(q + kv, kv),))],
        "self_attn.o_proj.weight": [_Target(attn.o_proj.weight, (hidden, q_all), (slice(None), _span(q0, q)))],
    }
    if cfg.qkv_bias:
        bias = attn.qkv_proj.bias
        table |= {
            "self_attn.q_proj.bias": [_Target(bias, (q_all,), (_span(q0, q),), (_span(0, q),))],
            "self_attn.k_proj.bias": [_Target(bias, (kv_all,), (_span(kv0, kv),), (_span(q, kv),))],
            "self_attn.v_proj.bias": [_Target(bias, (kv_all,), (_span(kv0, kv),), (_span(q + kv, kv),))],
        }
    if cfg.qk_norm:  # per head, the same for every head: replicated
        table |= {
            "self_attn.q_norm.weight": [_Target(attn.q_norm.weight, (d,))],
            "self_attn.k_norm.weight": [_Target(attn.k_norm.weight, (d,))],
        }
    return table


def _swiglu_table(prefix: str, gate_up: torch.Tensor, down: torch.Tensor, inter: int, inter_all: int,
                  hidden: int, shard: Shard, names=("gate_proj", "up_proj", "down_proj"),
                  lead: Index = ()) -> dict[str, list[_Target]]:
    """A SwiGLU MLP's three projections into its fused gate/up and its down weight, sharded
    (``lead``: the expert's index into stacked weights)."""
    i0 = shard.part(inter_all)[0]
    gate, up, dn = names
    rows = (_span(i0, inter),)
    return {
        f"{prefix}{gate}.weight": [_Target(gate_up, (inter_all, hidden), rows, (*lead, _span(0, inter)))],
        f"{prefix}{up}.weight": [_Target(gate_up, (inter_all, hidden), rows, (*lead, _span(inter, inter)))],
        f"{prefix}{dn}.weight": [_Target(down, (hidden, inter_all), (slice(None), _span(i0, inter)), lead)],
    }


def _mlp_table(mlp, cfg: ModelConfig, shard: Shard) -> dict[str, list[_Target]]:
    return _swiglu_table("mlp.", mlp.gate_up_proj.weight, mlp.down_proj.weight, mlp.inter,
                         cfg.intermediate_size, cfg.hidden_size, shard)


_EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_NAMES = {"mlp": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe": ("w1", "w3", "w2")}


def _moe_table(moe: SparseMoE, cfg: ModelConfig, shard: Shard, rest: str) -> dict[str, list[_Target]]:
    """Router, experts (stacked into ``w13`` / ``w2``; each expert's intermediate dimension
    sharded like the dense MLP's) and the shared expert, in the checkpoint layouts of the field:
    one tensor per expert and projection (Qwen ``mlp.experts.{e}.gate_proj``, Mixtral
    ``block_sparse_moe.experts.{e}.w1/w3/w2``) or pre-stacked (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``, as transformers 5 holds them)."""
    mc, hidden = cfg.moe, cfg.hidden_size
    n, inter, inter_all = mc.num_experts, moe.inter, mc.intermediate_size
    m = _EXPERT.match(rest)
    if m:  # one expert's projection: only that expert's entries, not a table of all of them
        prefix, e = m.group(1), int(m.group(2))
        if e >= n:
            return {}
        return _swiglu_table(f"{prefix}.experts.{e}.", moe.w13, moe.w2, inter, inter_all, hidden, shard,
                             names=_EXPERT_NAMES[prefix], lead=(e,))
    i0 = shard.part(inter_all)[0]
    every = slice(None)
    table: dict[str, list[_Target]] = {}
    for prefix in ("mlp.", "block_sparse_moe."):
        table[f"{prefix}gate.weight"] = [_Target(moe.gate.weight, (n, hidden))]
        table[f"{prefix}experts.gate_up_proj"] = [
            _Target(moe.w13, (n, 2 * inter_all, hidden), (every, _span(i0, inter)), (every, _span(0, inter))),
            _Target(moe.w13, (n, 2 * inter_all, hidden), (every, _span(inter_all + i0, inter)),
                    (every, _span(inter, inter))),
        ]
        table[f"{prefix}experts.down_proj"] = [
            _Target(moe.w2, (n, hidden, inter_all), (every, every, _span(i0, inter)))]
    if moe.shared_expert is not None:
        shared = moe.shared_expert
        table |= _swiglu_table("mlp.shared_expert.", shared.gate_up_proj.weight, shared.down_proj.weight,
                               shared.inter, mc.shared_expert_intermediate_size, hidden, shard)
        table["mlp.shared_expert_gate.weight"] = [_Target(shared.gate.weight, (1, hidden))]
    return table


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                shard: Shard | None = None, part: ModelPart | None = None) -> CausalLM:
    """An uninitialized model on ``device`` (no host-side random init of billions of weights);
    only ``part`` of it on a pipeline stage."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, shard)
        if part is not None:
            keep_stage(model, part)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg, max_positions).to(device)
    model.eval().requires_grad_(False)
    return model


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
               shard: Shard | None = None, part: ModelPart | None = None) -> CausalLM:
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{cfg.path} has no *.safetensors weights")
    model = build_model(cfg, device, dtype, max_positions, shard, part)
    expected = _expected_elements(model)
    loaded: dict[int, int] = {}
    for file in files:
        try:
            _load_file(model, cfg, file, device, loaded)
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise ModelError(f"cannot read weights {file.name}: {e}") from None
    missing = [name for pid, (name, count) in expected.items() if loaded.get(pid, 0) < count]
    if missing:
        raise ModelError(f"{cfg.path} is missing weights for {', '.join(missing[:3])}")
    if device.type == "cpu":
        pack_cpu_linears(model)
    use_default_experts(model, device, dtype)
    return model


def use_default_experts(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Give every MoE layer the experts backend of this device and dtype (see ``engine.moe``)."""
    for moe in model.modules():
        if isinstance(moe, SparseMoE):
            moe.use(default_experts(device, dtype))


def _load_file(model: CausalLM, cfg: ModelConfig, file: Path, device: torch.device, loaded: dict[int, int]) -> None:
    dev = str(device) if device.type == "cuda" else "cpu"
    with safe_open(str(file), framework="pt", device=dev) as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            targets = _targets(model, cfg, name)
            if not targets:
                continue
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if shape != targets[0].shape:
                raise ModelError(
                    f"weight {name} has shape {shape}, expected ({', '.join(map(str, targets[0].shape))})"
                )
            for target in targets:
                tensor = part[target.src] if target.src else part[:]
                dst = target.param[target.dst]
                if dst.shape != tensor.shape:  # a layout we mapped wrong must not broadcast silently
                    raise ModelError(f"weight {name}: a part of shape {tuple(tensor.shape)} does not fit "
                                     f"its place of shape {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(tensor)
                # every element of every parameter is written once: count them
                loaded[id(target.param)] = loaded.get(id(target.param), 0) + tensor.numel()


def _expected_elements(model: CausalLM) -> dict[int, tuple[str, int]]:
    return {id(p): (name, p.numel()) for name, p in model.named_parameters(remove_duplicate=True)}
