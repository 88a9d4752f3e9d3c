"""Load a Hugging Face Llama-family checkpoint into ``CausalLM`` (and DeepSeek-V3's MTP layer
into ``engine.mtp.MtpLayer``).

Weights are streamed tensor by tensor from ``*.safetensors`` straight onto the
target device; the fused QKV and gate/up parameters, and the stacked experts of
MoE layers, are filled slice by slice. A tensor-parallel rank reads only its
shard of each sharded tensor, a pipeline stage only its layers (``ModelPart``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.fp8 import FP8_DTYPE, Fp8Reader, block_index
from engine.fp8_linear import BlockFp8Gemm, Fp8Linear, resident_gemm
from engine.model import CausalLM, HeldElsewhere, ModelPart, Rotary, keep_stage, pack_cpu_linears
from engine.moe import GroupedTopKRouter, SparseMoE, count_expert_tokens, default_experts
from engine.mtp import MtpLayer
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
    origin: str = ""  # which config fields make ``shape`` (named when the checkpoint disagrees)


Targets = Callable[[str], list[_Target]]  # where a checkpoint tensor goes, by its name (a module's table)


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
    if i >= cfg.num_layers:  # past the last: MTP layers (``load_mtp_layer``'s)
        return []
    if isinstance(model.layers[i], HeldElsewhere):  # another pipeline stage's
        return []
    return _decoder_targets(model.layers[i], cfg, model.shard, rest)


def _decoder_targets(layer, cfg: ModelConfig, shard: Shard, rest: str) -> list[_Target]:
    """Where a decoder layer's tensor goes (``rest``: its name after ``model.layers.{i}.``)."""
    table = {}
    if layer.self_attn is not None:  # None: a rank that holds experts only
        table = _mla_table(layer, cfg, shard) if cfg.mla else _attention_table(layer, cfg, shard)
    mlp = layer.mlp
    table |= _moe_table(mlp, cfg, shard, rest) if isinstance(mlp, SparseMoE) else _mlp_table(mlp, cfg, shard)
    return table.get(rest, [])


def _mtp_targets(layer: MtpLayer, cfg: ModelConfig, name: str) -> list[_Target]:
    """Where a tensor of the first MTP layer goes (``engine.mtp``); its copies of the model's
    embeddings and head are not loaded (the model's serve)."""
    prefix = f"model.layers.{cfg.num_layers}."
    if not name.startswith(prefix):
        return []
    rest, h = name[len(prefix):], cfg.hidden_size
    own = {"enorm.weight": (layer.enorm.weight, (h,)), "hnorm.weight": (layer.hnorm.weight, (h,)),
           "eh_proj.weight": (layer.eh_proj.weight, (h, 2 * h)),
           "shared_head.norm.weight": (layer.head_norm.weight, (h,))}
    if rest in own:
        param, shape = own[rest]
        return [_Target(param, shape)]
    return _decoder_targets(layer.block, cfg, Shard(), rest)


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


def _mla_table(layer, cfg: ModelConfig, shard: Shard) -> dict[str, list[_Target]]:
    """Latent attention (``engine.mla``): the query's, the latent's and the output's projections.
    Per-head tensors are this rank's heads' rows (``q_b_proj``/``q_proj``, ``kv_b_proj``) or
    columns (``o_proj``); the latent ones are whole."""
    attn, mla, hidden = layer.self_attn, cfg.mla, cfg.hidden_size
    heads = cfg.num_heads
    h0, h = shard.part(heads)
    qk, kv_b, v = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim, mla.v_head_dim
    heads_of = f"num_attention_heads {heads}"
    origin = {
        "q": f"{heads_of} x (qk_nope_head_dim {mla.qk_nope_head_dim} + qk_rope_head_dim {mla.qk_rope_head_dim})",
        "q_lora": f"q_lora_rank {mla.q_lora_rank}",
        "kv_lora": f"kv_lora_rank {mla.kv_lora_rank}",
        "kv_a": f"kv_lora_rank {mla.kv_lora_rank} + qk_rope_head_dim {mla.qk_rope_head_dim}",
        "kv_b": f"{heads_of} x (qk_nope_head_dim {mla.qk_nope_head_dim} + v_head_dim {v}), kv_lora_rank "
                f"{mla.kv_lora_rank}",
        "o": f"{heads_of} x v_head_dim {v}",
    }

    def whole(param, shape, key):
        return [_Target(param, shape, origin=origin[key])]

    def head_rows(param, per_head, cols, key):
        return [_Target(param, (heads * per_head, cols), (_span(h0 * per_head, h * per_head),), origin=origin[key])]

    table = {
        "input_layernorm.weight": [_Target(layer.input_layernorm.weight, (hidden,))],
        "post_attention_layernorm.weight": [_Target(layer.post_attention_layernorm.weight, (hidden,))],
        "self_attn.kv_a_proj_with_mqa.weight": whole(attn.kv_a_proj_with_mqa.weight, (mla.latent_dim, hidden), "kv_a"),
        "self_attn.kv_a_layernorm.weight": whole(attn.kv_a_layernorm.weight, (mla.kv_lora_rank,), "kv_lora"),
        "self_attn.kv_b_proj.weight": head_rows(attn.kv_b_proj.weight, kv_b, mla.kv_lora_rank, "kv_b"),
        "self_attn.o_proj.weight": [_Target(attn.o_proj.weight, (hidden, heads * v), (slice(None), _span(h0 * v, h * v)),
                                            origin=origin["o"])],
    }
    if mla.q_lora_rank is None:
        table["self_attn.q_proj.weight"] = head_rows(attn.q_proj.weight, qk, hidden, "q")
    else:
        table |= {
            "self_attn.q_a_proj.weight": whole(attn.q_a_proj.weight, (mla.q_lora_rank, hidden), "q_lora"),
            "self_attn.q_a_layernorm.weight": whole(attn.q_a_layernorm.weight, (mla.q_lora_rank,), "q_lora"),
            "self_attn.q_b_proj.weight": head_rows(attn.q_b_proj.weight, qk, mla.q_lora_rank, "q"),
        }
    if mla.attention_bias:  # o_proj's bias is whole: with one rank (check_tp refuses more for MLA)
        table["self_attn.kv_a_proj_with_mqa.bias"] = whole(attn.kv_a_proj_with_mqa.bias, (mla.latent_dim,), "kv_a")
        table["self_attn.o_proj.bias"] = [_Target(attn.o_proj.bias, (hidden,))]
        if mla.q_lora_rank is not None:
            table["self_attn.q_a_proj.bias"] = whole(attn.q_a_proj.bias, (mla.q_lora_rank,), "q_lora")
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
    sharded like the dense MLP's, or under EP this rank's experts whole) and the shared expert,
    in the checkpoint layouts of the field: one tensor per expert and projection (Qwen
    ``mlp.experts.{e}.gate_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``) or
    pre-stacked (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``
    ``[E, H, I]``, as transformers 5 holds them)."""
    mc, hidden = cfg.moe, cfg.hidden_size
    n, inter, inter_all = mc.num_experts, moe.inter, mc.intermediate_size
    held = moe.local_experts
    if moe.shard.experts is not None:  # whole experts (and shared experts): no TP share of their columns
        shard = Shard()
    m = _EXPERT.match(rest)
    if m:  # one expert's projection: only that expert's entries, not a table of all of them
        prefix, e = m.group(1), int(m.group(2))
        if e not in held:
            return {}
        return _swiglu_table(f"{prefix}.experts.{e}.", moe.w13, moe.w2, inter, inter_all, hidden, shard,
                             names=_EXPERT_NAMES[prefix], lead=(e - held.start,))
    i0 = shard.part(inter_all)[0]
    every, mine = slice(None), _span(held.start, len(held))
    table: dict[str, list[_Target]] = {}
    for prefix in ("mlp.", "block_sparse_moe."):
        if moe.gate is not None:  # None: a rank that holds experts only
            table[f"{prefix}gate.weight"] = [_Target(moe.gate.weight, (n, hidden))]
        table[f"{prefix}experts.gate_up_proj"] = [
            _Target(moe.w13, (n, 2 * inter_all, hidden), (mine, _span(i0, inter)), (every, _span(0, inter))),
            _Target(moe.w13, (n, 2 * inter_all, hidden), (mine, _span(inter_all + i0, inter)),
                    (every, _span(inter, inter))),
        ]
        table[f"{prefix}experts.down_proj"] = [
            _Target(moe.w2, (n, hidden, inter_all), (mine, every, _span(i0, inter)))]
    if isinstance(moe.router, GroupedTopKRouter):  # DeepSeek: the bias that balances the choice
        table["mlp.gate.e_score_correction_bias"] = [_Target(moe.router.e_score_correction_bias, (n,))]
    if moe.shared_expert is not None:
        shared = moe.shared_expert
        # Qwen2-MoE: one gated ``shared_expert``; DeepSeek: ``shared_experts``, stored as one MLP
        prefix = "mlp.shared_expert." if shared.gate is not None else "mlp.shared_experts."
        table |= _swiglu_table(prefix, shared.gate_up_proj.weight, shared.down_proj.weight,
                               shared.inter, mc.shared_expert_intermediate_size, hidden, shard)
        if shared.gate is not None:
            table["mlp.shared_expert_gate.weight"] = [_Target(shared.gate.weight, (1, hidden))]
    return table


def _materialize(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A module built on the meta device, made real (uninitialized) on ``device``: no host-side
    random init of billions of weights. (Not ``Module.to_empty``: its ``empty_like`` of a meta
    tensor runs torch's Python reference ops, whose first call imports sympy and torch.fx: ~1 s of
    CPU in every worker's start. Parameters tied on meta come apart here: the caller re-ties them.)"""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                real = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                table[name] = torch.nn.Parameter(real, requires_grad=False) if isinstance(t, torch.nn.Parameter) else real
    module = module.to(dtype)
    for moe in module.modules():
        if isinstance(moe, SparseMoE):
            moe.keep_router_fp32()
            # built on the meta device too; a model's own rows come from count_expert_tokens
            moe.expert_tokens = torch.zeros_like(moe.expert_tokens, device=device)
    return module.eval().requires_grad_(False)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                shard: Shard | None = None, part: ModelPart | None = None) -> CausalLM:
    """An uninitialized model on ``device``; only ``part`` of it on a pipeline stage."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, shard)
        if part is not None:
            keep_stage(model, part)
    model = _materialize(model, device, dtype)
    model.expert_tokens = count_expert_tokens(model, device)
    if cfg.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg, max_positions).to(device)
    return model


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
               shard: Shard | None = None, part: ModelPart | None = None) -> CausalLM:
    files = _weight_files(cfg)
    model = build_model(cfg, device, dtype, max_positions, shard, part)
    _load_weights(model, cfg, files, device, dtype, lambda name: _targets(model, cfg, name))
    return model


def load_mtp_layer(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> MtpLayer:
    """The checkpoint's first multi-token-prediction layer (``engine.mtp``), stored after the last
    decoder layer; its MLP sparse where the checkpoint stores experts for it. ModelError in one
    line where its weights are not there (a checkpoint saved without them)."""
    files = _weight_files(cfg)
    prefix = f"model.layers.{cfg.num_layers}."
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(n for n in f.keys() if n.startswith(prefix))  # noqa: SIM118 (not a mapping)
    if f"{prefix}eh_proj.weight" not in names:
        raise ModelError(f"{cfg.path} declares num_nextn_predict_layers {cfg.mtp_layers} but has no weights for "
                         f"its MTP layer ({prefix}eh_proj.weight): a checkpoint saved without it")
    with torch.device("meta"):
        layer = MtpLayer(cfg, sparse=f"{prefix}mlp.gate.weight" in names)
    layer = _materialize(layer, device, dtype)
    _load_weights(layer, cfg, files, device, dtype, lambda name: _mtp_targets(layer, cfg, name))
    return layer


def _weight_files(cfg: ModelConfig) -> list[Path]:
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{cfg.path} has no *.safetensors weights")
    return files


def _load_weights(module: torch.nn.Module, cfg: ModelConfig, files: list[Path], device: torch.device,
                  dtype: torch.dtype, targets: Targets) -> None:
    """Every parameter of ``module`` from the checkpoint tensors ``targets`` places (each element
    written once, or ModelError naming what is missing), then the device's linear and expert
    kernels."""
    fp8 = Fp8Reader(cfg.fp8, files)
    gemm = resident_gemm(device, cfg.fp8.block, dtype) if cfg.fp8 else None
    if gemm is not None:
        _keep_fp8_resident(module, cfg, fp8, gemm, targets)
    expected = _expected_elements(module)
    loaded: dict[int, int] = {}
    for file in files:
        try:
            _load_file(targets, file, device, loaded, fp8)
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise ModelError(f"cannot read weights {file.name}: {e}") from None
    missing = [name for pid, (name, count) in expected.items() if loaded.get(pid, 0) < count]
    if missing:
        raise ModelError(f"{cfg.path} is missing weights for {', '.join(missing[:3])}")
    if device.type == "cpu":
        pack_cpu_linears(module)
    use_default_experts(module, device, dtype)


def _keep_fp8_resident(module: torch.nn.Module, cfg: ModelConfig, fp8: Fp8Reader, gemm: BlockFp8Gemm,
                       targets: Targets) -> None:
    """Swap for an ``Fp8Linear`` every linear layer whose whole weight comes from FP8 tensors in
    block-aligned parts (``fp8.resident`` then names its scales); the others stay in the model's
    dtype and their FP8 tensors are dequantized as they load."""
    block = cfg.fp8.block
    feeds: dict[int, list[_Target]] = {}
    for name in fp8.fp8_names:
        for t in targets(name):
            feeds.setdefault(id(t.param), []).append(t)
    for parent in list(module.modules()):
        for attr, linear in list(parent.named_children()):
            parts = feeds.get(id(getattr(linear, "weight", None)))
            if (not isinstance(linear, torch.nn.Linear) or not parts
                    or not gemm.supports(linear.out_features, linear.in_features, block)):
                continue
            shape = tuple(linear.weight.shape)
            whole = sum(linear.weight[t.dst].numel() for t in parts) == linear.weight.numel()
            if whole and all(block_index(t.src, t.shape, block) and block_index(t.dst, shape, block) for t in parts):
                layer = Fp8Linear.like(linear, block, gemm)
                setattr(parent, attr, layer)
                fp8.resident[id(layer.weight)] = layer.weight_scale_inv


def use_default_experts(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every MoE layer the experts backend of this device and dtype (see ``engine.moe``)."""
    for moe in model.modules():
        if isinstance(moe, SparseMoE):
            moe.use(default_experts(device, dtype))


def _load_file(targets_of: Targets, file: Path, device: torch.device, loaded: dict[int, int],
               fp8: Fp8Reader) -> None:
    dev = str(device) if device.type == "cuda" else "cpu"
    with safe_open(str(file), framework="pt", device=dev) as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            targets = targets_of(name)
            if not targets:
                continue
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            whole = fp8.read(f, name, part, targets[0].param.dtype)  # FP8: dequantized (or as stored), then sliced
            if whole is not None:
                part = whole
            if shape != targets[0].shape:
                origin = targets[0].origin
                raise ModelError(
                    f"weight {name} has shape {shape}, expected ({', '.join(map(str, targets[0].shape))})"
                    + (f" from config.json's {origin}" if origin else "")
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
            if whole is not None and whole.dtype == FP8_DTYPE:  # a resident FP8 weight: its scales beside it
                fp8.place_scales(f, name, targets, loaded)


def _expected_elements(model: torch.nn.Module) -> dict[int, tuple[str, int]]:
    return {id(p): (name, p.numel()) for name, p in model.named_parameters(remove_duplicate=True)}
