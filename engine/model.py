"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, and the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE; DeepSeek-V3 with its latent attention) over a flat token batch.

Tokens of all scheduled sequences are concatenated (``[T]``); attention is the
backend's business, so the model itself has no notion of sequences or padding.
QKV and gate/up projections are fused into one matmul each. A layer's MLP is dense
(``MLP``) or sparse (``engine.moe.SparseMoE``) as ``ModelConfig.is_sparse`` says; its
attention per head (``Attention``) or latent (``engine.mla.LatentAttention``) as ``ModelConfig.mla`` says.
The residual stream runs beside the hidden states (``residual``) so that its add and
the next norm can be one kernel; which operations run fused kernels is the model's
``Kernels`` (``engine.kernels``; plain PyTorch unless ``use_kernels`` chose others).

Under tensor parallelism (``Shard``, see ``engine.tp``) a rank holds its
share of the heads and MLP columns; the row-parallel ``o_proj`` and
``down_proj`` sum their partial outputs over the ranks. Under pipeline
parallelism (``engine.parallel``) a rank holds its stage's layers only
(``keep_stage``: the others are ``HeldElsewhere``, so layer numbers stay the
model's) and runs them with ``forward_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.kernels import PLAIN, Kernels, torch_rmsnorm
from engine.mla import LatentAttention
from engine.moe import SparseMoE
from engine.tp import Shard


class RMSNorm(nn.Module):
    kernels: Kernels = PLAIN

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``RMSNorm(x)``; with ``residual``, ``(RMSNorm(residual + x), residual + x)``."""
        if residual is None:
            return torch_rmsnorm(x, self.weight, self.eps)
        return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialised: its weights come from the checkpoint. (Its random
    init on the meta device, where the loader builds models, runs torch's Python reference ops,
    whose first call imports torch._dynamo: ~1.7 s of CPU in every worker's start.)"""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class Rotary(nn.Module):
    """cos/sin tables for all positions, in the rotate-half convention of HF Llama."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        if torch.empty(0).device.type == "meta":  # a skeleton (engine.loader): the tables come after
            shape = (max_positions, cfg.head_dim)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
            return
        inv_freq = cfg.rope.inv_freq(cfg.head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = cfg.rope.attention_factor  # YaRN's; 1 otherwise
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` of the step's positions: once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def cos_sin_cache(self) -> torch.Tensor:
        """float32 ``[max_positions, head_dim]``: cos of the half-dimension frequencies, then sin
        (the table FlashInfer's rope kernel reads); built once."""
        cache = getattr(self, "_cos_sin", None)
        if cache is None:
            half = self.cos.shape[1] // 2
            cache = self._cos_sin = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=1).float().contiguous()
        return cache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        self.layer = layer
        self.shard = shard
        _, self.num_heads = shard.part(cfg.num_heads)
        _, self.num_kv_heads = shard.part(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope, attn: AttentionBackend):
        """``rope``: the step's rotary embedding (``Kernels.rope``), shared by every layer."""
        T, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        v = qkv[:, hq + hkv :]
        if self.q_norm is None:
            # q and k are adjacent heads of the fused projection: one rotation for both
            q, k = rope.rotate_fused(qkv[:, : hq + hkv], hq)
        else:
            q, k = rope.rotate_qk(self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv]))
        o = attn.forward(self.layer, q, k, v)
        return self.shard.all_reduce(self.o_proj(o.reshape(T, self.q_size)))


class MLP(nn.Module):
    kernels: Kernels = PLAIN

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        _, self.inter = shard.part(cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, layer, shard) if cfg.mla else Attention(cfg, layer, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, shard, layer) if cfg.is_sparse(layer) else MLP(cfg, shard)

    def forward(self, x, residual, rope, attn):
        """``(mlp output, residual stream)``: the stream is the sum of the embeddings and every
        block's output before this one's MLP; ``residual`` None at the first layer."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    kernels: Kernels = PLAIN
    # EAGLE-3 (engine.eagle3), MTP (engine.mtp): the layers whose input (the residual stream; 0 is
    # the embeddings, ``len(layers)`` the last layer's output: the hidden states before the final
    # norm) each step keeps, concatenated in ``aux_hidden [T, len(aux_layers) * hidden]``. Empty: none kept.
    # Under TP the stream is whole on every rank (each layer ends in an all-reduce): rank 0 keeps it.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None
    expert_tokens: torch.Tensor | None = None  # MoE: pairs routed per (sparse layer, expert) since start

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard or Shard()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm."""
        if self.aux_layers:
            hidden, self.aux_hidden = self.forward_aux(input_ids, positions, attn)
            return hidden
        x, residual = self.forward_layers(self.embed_tokens(input_ids), None, positions, attn, range(len(self.layers)))
        return residual + x

    def forward_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                       attn: AttentionBackend, layers: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` (a pipeline stage's, or all of them) over ``x`` and the residual stream
        (None before the first layer): ``(mlp output, residual stream)`` after the last one."""
        rope = self.kernels.rope(self.rotary, positions, x.dtype)
        for i in layers:
            x, residual = self.layers[i](x, residual, rope, attn)
        self._end_forward(x.device)
        return x, residual

    def _end_forward(self, device: torch.device) -> None:
        """Expert parallelism: the ranks that hold experts only serve until every forward says it is over."""
        if self.shard.experts is not None:
            self.shard.experts.dispatch.end_forward(self.cfg.moe.num_experts, device)

    def forward_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                    whole: bool = True, aux_layers: tuple[int, ...] | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``forward``'s hidden states, and the inputs of the ``aux_layers`` (the model's unless
        given: a tensor-parallel helper rank keeps none) concatenated; with ``whole`` False, only
        the layers up to the last of them run (no hidden states: None)."""
        aux_layers = self.aux_layers if aux_layers is None else aux_layers
        x = self.embed_tokens(input_ids)
        rope = self.kernels.rope(self.rotary, positions, x.dtype)
        residual = None
        kept = {}
        last = max(aux_layers)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                kept[i] = x if residual is None else x + residual
            if i == last and not whole:
                break
            x, residual = layer(x, residual, rope, attn)
        if len(self.layers) in aux_layers:  # the last layer's output (then every layer ran)
            kept[len(self.layers)] = residual + x
        self._end_forward(x.device)
        aux = torch.cat([kept[i] for i in aux_layers], dim=-1)
        return (residual + x if whole else None), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()


class HeldElsewhere(nn.Module):
    """In place of a decoder layer another pipeline stage holds: no weights, never run."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        raise RuntimeError(f"layer {self.layer} is held by another pipeline stage")


@dataclass(frozen=True)
class ModelPart:
    """What of the model one rank holds: its stage's decoder ``layers``, the embeddings where it
    ``embeds`` (the first stage), the final norm and ``lm_head`` where it ``samples`` (rank 0);
    without ``attention``, of the layers only their routed experts (an EP rank that holds
    experts only: ``engine.parallel.expert_rank``)."""

    layers: range
    embeds: bool = True
    samples: bool = True
    attention: bool = True


def keep_stage(model: CausalLM, part: ModelPart) -> None:
    """Trim ``model`` (built on the meta device, before its weights are allocated) to ``part``:
    the layers of other stages become ``HeldElsewhere``, whatever their type (the split is by
    position in ``model.layers``)."""
    for i in range(len(model.layers)):
        if i not in part.layers or not (part.attention or isinstance(model.layers[i].mlp, SparseMoE)):
            model.layers[i] = HeldElsewhere(i)
        elif not part.attention:  # the routed experts alone: no attention, norms, router or shared experts
            layer = model.layers[i]
            layer.input_layernorm = layer.self_attn = layer.post_attention_layernorm = None
            layer.mlp.gate = layer.mlp.router = layer.mlp.shared_expert = None
    if not part.samples:
        model.norm = model.lm_head = None
    if not part.embeds:
        model.embed_tokens = None


def held_layers(model: CausalLM) -> list[int]:
    """The decoder layers this rank holds."""
    return [i for i, layer in enumerate(model.layers) if not isinstance(layer, HeldElsewhere)]


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Run the model's fusable operations on ``kernels`` (``Kernels.select``)."""
    for m in model.modules():
        if isinstance(m, (CausalLM, RMSNorm, MLP)):
            m.kernels = kernels


# -- CPU: linear layers on oneDNN with pre-packed weights ------------------------------------

PACK_BATCH_HINT = 32  # oneDNN picks its weight layout for about this many rows (a decode batch)


class PackedLinear(nn.Module):
    """``nn.Linear`` on CPU through oneDNN with the weight reordered once, at load time, into
    the blocked layout its kernels read. ``F.linear`` hands the plain weight to the BLAS, which
    re-packs it on every call; at decode batch sizes that re-packing is most of the matmul,
    and decode steps are mostly matmuls. The packed copy replaces the weight (same bytes)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_cpu_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of a CPU model for a ``PackedLinear``; returns how many.

    Leaves the model as it is where oneDNN is unavailable for this dtype or its first layer
    does not reproduce ``F.linear`` (then the plain path serves, only slower).
    """
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if not linears or not torch.backends.mkldnn.is_available():
        return 0
    first = linears[0][2]
    if first.weight.device.type != "cpu" or first.weight.dtype not in (torch.float32, torch.bfloat16):
        return 0
    try:
        packed = PackedLinear(first)
        x = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0)).to(first.weight.dtype)
        with torch.no_grad():
            ok = torch.allclose(packed(x).float(), first(x).float(), rtol=1e-2, atol=1e-3)
    except (RuntimeError, AttributeError):  # an op this torch build lacks
        ok = False
    if not ok:
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return len(linears)

