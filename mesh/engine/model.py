"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, and the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat token batch.

Tokens of all scheduled sequences are concatenated (``[T]``); attention is the
backend's business, so the model itself has no notion of sequences or padding.
QKV and gate/up projections are fused into one matmul each. A layer's MLP is dense
(``MLP``) or sparse (``mesh.engine.moe.SparseMoE``) as ``ModelConfig.is_sparse`` says.

Under tensor parallelism (``Shard``, see ``mesh.engine.tp``) a rank holds its
share of the heads and MLP columns; the row-parallel ``o_proj`` and
``down_proj`` sum their partial outputs over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mesh.engine.attention import AttentionBackend
from mesh.engine.config import ModelConfig
from mesh.engine.moe import SparseMoE
from mesh.engine.tp import Shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers does it: normalize in fp32, cast back, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for all positions, in the rotate-half convention of HF Llama."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = cfg.rope.inv_freq(cfg.head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` of the step's positions: once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend):
        T, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        v = qkv[:, hq + hkv :]
        if self.q_norm is None:
            # q and k are adjacent heads of the fused projection: one rotation for both
            qk = apply_rotary(qkv[:, : hq + hkv], *rope)
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :hq]), *rope)
            k = apply_rotary(self.k_norm(qkv[:, hq : hq + hkv]), *rope)
        o = attn.forward(self.layer, q, k, v)
        return self.shard.all_reduce(self.o_proj(o.reshape(T, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        _, self.inter = shard.part(cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.shard.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, shard) if cfg.is_sparse(layer) else MLP(cfg, shard)

    def forward(self, x, rope, attn):
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard or Shard()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attn)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()


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

