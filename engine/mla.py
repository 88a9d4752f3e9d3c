"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) over a flat token batch.

    x --q_a_proj--> q_a_layernorm --q_b_proj-->  q [T, H, nope + rope]    (or x --q_proj--> q)
    x --kv_a_proj_with_mqa--> latent [T, C] (kv_a_layernorm'd), k_pe [T, R] (one rope key, every head)

The cache keeps ``latent | rope(k_pe)``, one vector of ``C + R`` values per token and layer,
never a key and value per head (``ModelConfig.kv_cache_spec``: one plane, one "head").
Attention runs in the absorbed form, for decode and prefill alike: ``kv_b_proj`` is
``[H, nope + v, C]``; its key part ``W_uk`` is folded into the query
(``q_nope @ W_uk``: each head's query in latent space), so scores are
``(q_nope W_uk) . latent + rope(q_pe) . rope(k_pe)`` straight off the cache; the output in
latent space goes through the value part ``W_uv`` per head, then ``o_proj``. That is the
form FlashInfer's MLA paged kernels take (``engine.attention.mla_flashinfer``) and the one
the torch backend runs on CPU (``mla_torch``: one-KV-head attention of dim ``C + R``).

Why the absorbed form for prefill too: one cache read path, so chunked prefill and prefix
hits attend over the cached latents as decode does, with no re-expansion of the cached
prefix through ``kv_b_proj``, and one kernel family on the GPU. What it costs: per
(query, key) pair a head multiplies ``C + R`` values for the scores and ``C`` for the
output (576 + 512 for DeepSeek-V3) where the expanded form, K and V per head, multiplies
``nope + rope`` and ``v`` (192 + 128). For long prompts on a GPU the expanded form (a
ragged MHA prefill over ``kv_b_proj(latent)``, as vLLM and SGLang run) is the faster one:
the next step when prefill throughput on DeepSeek matters.

Under tensor parallelism a rank would hold its share of the heads (``q_b_proj``/``q_proj``,
``kv_b_proj``, ``o_proj``) and the whole latent; ``ModelConfig.check_tp`` refuses it for now.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import apply_rotary, torch_rmsnorm
from engine.tp import Shard


class LatentNorm(nn.Module):
    """RMSNorm of the query and KV latents (``q_a_layernorm``, ``kv_a_layernorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rmsnorm(x, self.weight, self.eps)


class Absorbed(nn.Module):
    """``kv_b_proj``'s weight ``[H * (nope + v), C]``, never run as a linear layer: its key and
    value parts are multiplied per head into the query and the output (see the module doc)."""

    def __init__(self, heads: int, nope: int, v: int, latent: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, nope, v
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), latent))

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``[T, H, nope] -> [T, H, C]``: each head's query against the latent."""
        w_uk = self.weight.view(self.heads, self.nope + self.v, -1)[:, : self.nope]  # [H, nope, C]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, o: torch.Tensor) -> torch.Tensor:
        """``[T, H, C] -> [T, H * v]``: each head's attention output in latent space, through its values."""
        w_uv = self.weight.view(self.heads, self.nope + self.v, -1)[:, self.nope :]  # [H, v, C]
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(o.shape[0], -1)


def rotate_mla(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rope on ``x [T, H, R]`` with the step's ``cos``/``sin`` ``[T, 1, R]`` (``cat(freqs, freqs)``).

    ``interleave``: DeepSeek's checkpoints pair the rope dims as ``(x0, x1), (x2, x3), ...``;
    the rotated pairs come out de-interleaved (all first halves, then all second halves), as
    transformers computes them. Queries and keys get the same layout, so their dot products
    are the rotation's."""
    if not interleave:
        return apply_rotary(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentAttention(nn.Module):
    """MLA for one decoder layer (what ``DecoderLayer`` runs instead of ``Attention`` when
    ``ModelConfig.mla`` is set). ``forward(x, rope, attn)``: ``rope`` the step's ``TorchRope``
    (its cos/sin tables), ``attn`` a latent attention backend."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer, self.shard, self.mla = layer, shard, mla
        _, self.num_heads = shard.part(cfg.num_heads)
        hidden, heads, bias = cfg.hidden_size, self.num_heads, mla.attention_bias
        q_out = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = LatentNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = LatentNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Absorbed(heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, rope, attn) -> torch.Tensor:
        mla, T = self.mla, x.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, self.num_heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        q_pe = rotate_mla(q_pe, rope.cos, rope.sin, mla.rope_interleave)
        k_pe = rotate_mla(k_pe.unsqueeze(1), rope.cos, rope.sin, mla.rope_interleave).squeeze(1)
        query = torch.cat([self.kv_b_proj.absorb_query(q_nope), q_pe], dim=-1)  # [T, H, C + R]
        cached = torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)  # [T, C + R]: what the cache keeps
        o = attn.forward(self.layer, query, cached)  # [T, H, C]
        return self.shard.all_reduce(self.o_proj(self.kv_b_proj.expand_output(o)))


def check_latent_support(mc: ModelConfig, config) -> None:
    """Refuse at start, in one line, what does not run with latent attention yet (``config``: the
    ``EngineConfig``). ``--tp > 1`` is ``ModelConfig.check_tp``'s."""
    if mc.mla is None:
        return
    model = f"MLA models ({mc.family})"
    if config.lora_slots:
        raise ValueError(f"LoRA adapters are not supported on {model} yet (their attention has no q/k/v projections)")
    if "rope" in config.fused_kernels:
        raise ValueError(f"--fused-kernels rope does not serve {model}: it rotates per-head q and k, "
                         "MLA a shared rope key (leave rope out)")
    method = (config.speculative or "").partition(":")[0]
    if method == "eagle3":
        raise ValueError(f"--speculative eagle3 is not supported on {model} yet (ngram, draft and mtp are)")
