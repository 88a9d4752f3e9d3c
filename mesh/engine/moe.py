"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat token batch.

    x --router--> top-k experts and weights per token --experts backend--> sum_k w * expert_k(x)
      \\--shared expert (Qwen2-MoE), gated by sigmoid(shared_expert_gate(x))--/

Every expert is a SwiGLU MLP; their weights are stacked, ``w13`` ``[E, 2*I, H]`` (each
expert's gate rows, then its up rows: the dense MLP's fused layout) and ``w2`` ``[E, H, I]``.
Under tensor parallelism each rank holds its share of every expert's intermediate dimension
(as the dense MLP does), so the experts' output is a partial sum and one all-reduce per layer
adds them up, shared expert included.

How the chosen experts run is an ``ExpertsBackend`` picked by name from ``EXPERTS``:
``grouped`` (any device: tokens sorted by expert, one matmul pair per expert that has tokens;
no dense all-experts compute) and ``flashinfer`` (CUDA, half precision: FlashInfer's fused
CUTLASS MoE kernel). ``default_experts`` picks one for a device and dtype.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mesh.engine.config import ModelConfig
from mesh.engine.tp import Shard

log = logging.getLogger(__name__)


class TopKRouter:
    """softmax over the router logits (fp32), the ``k`` largest, optionally renormalised to sum to 1.

    Mixtral always renormalises; Qwen2/3-MoE do when ``norm_topk_prob``. The weights come back
    in the activations' dtype, as the reference implementations apply them."""

    def __init__(self, top_k: int, renormalize: bool):
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids ``[T, k]`` int64, weights ``[T, k]`` in ``dtype``)"""
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(dtype)


class ExpertsBackend(Protocol):
    """Runs each token's chosen experts and sums their outputs by the routing weights.

    Contract: ``forward(x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids [T, k], weights [T, k])``
    returns ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = ids[t, j]``,
    ``[T, H]`` in ``x``'s dtype; ``w13`` holds each expert's gate rows then its up rows as the
    loader wrote them, unless ``prepare`` rewrote them into the backend's own layout (once, after
    loading; a backend that rewrites must be the only one to run on that module).
    """

    name: str

    def prepare(self, moe: SparseMoE) -> None: ...

    def forward(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor: ...


class GroupedExperts:
    """Any device, any dtype: sort the (token, expert) pairs by expert, then for each expert that
    has tokens one gate/up matmul and one down matmul over its contiguous rows; the weighted rows
    are added back onto their tokens. Work is proportional to ``T * k``, never to ``E``."""

    name = "grouped"

    def prepare(self, moe: SparseMoE) -> None:
        pass

    def forward(self, x, w13, w2, ids, weights):
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair j = (token j // k, its (j % k)-th expert)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # one host sync per layer
        tokens = order // k
        xs = x.index_select(0, tokens)
        rows = torch.empty_like(xs)
        inter = w2.shape[2]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start : start + n]
            gate_up = F.linear(seg, w13[e])
            rows[start : start + n] = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
            start += n
        rows.mul_(weights.reshape(-1, 1).index_select(0, order))
        # pairs are added onto their token in expert order, as the reference implementations do
        return torch.zeros_like(x).index_add_(0, tokens, rows)


class FlashInferExperts:
    """CUDA, bf16/fp16: FlashInfer's fused CUTLASS MoE (``flashinfer.fused_moe.cutlass_fused_moe``):
    routing permutation, both grouped GEMMs, SwiGLU and the weighted combine in its kernels.

    Its fc1 layout is ``[E, 2I, H]`` with the *up* rows first, then the gate rows (TensorRT-LLM's
    "w31"), so ``prepare`` swaps the halves of ``w13`` in place, once. Tensor parallelism is ours:
    the kernel sees this rank's shard as whole experts and we all-reduce its partial sums."""

    name = "flashinfer"

    def __init__(self):
        from flashinfer.fused_moe import cutlass_fused_moe  # ImportError: not available here

        self._moe = cutlass_fused_moe

    def prepare(self, moe: SparseMoE) -> None:
        inter = moe.inter
        with torch.no_grad():
            gate = moe.w13[:, :inter].clone()
            moe.w13[:, :inter].copy_(moe.w13[:, inter:])
            moe.w13[:, inter:].copy_(gate)

    def forward(self, x, w13, w2, ids, weights):
        out = torch.empty_like(x)
        result = self._moe(x.contiguous(), ids.to(torch.int32), weights.to(torch.float32), w13, w2,
                           x.dtype, quant_scales=None, output=out)
        # some releases return the output, others a list whose first item it is
        return result[0] if isinstance(result, list | tuple) else result


EXPERTS: dict[str, type] = {"grouped": GroupedExperts, "flashinfer": FlashInferExperts}


def create_experts(name: str) -> ExpertsBackend:
    try:
        cls = EXPERTS[name]
    except KeyError:
        raise ValueError(f"unknown MoE experts backend {name!r} (choose from {', '.join(EXPERTS)})") from None
    return cls()


def default_experts(device: torch.device, dtype: torch.dtype) -> ExpertsBackend:
    """FlashInfer's fused kernel on CUDA in half precision when it is installed, else grouped."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        try:
            return FlashInferExperts()
        except ImportError:
            log.info("flashinfer is not installed: MoE layers run the grouped experts")
    return GroupedExperts()


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert that every token runs, scaled per token by a sigmoid gate.
    Column/row-parallel like the dense MLP; its output is a partial sum (the MoE reduces)."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard):
        super().__init__()
        _, self.inter = shard.part(intermediate)
        self.gate_up_proj = nn.Linear(hidden, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False)  # replicated: every rank scales its part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return torch.sigmoid(self.gate(x)) * self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """The mixture-of-experts MLP of one decoder layer (what ``DecoderLayer`` runs instead of
    ``MLP`` where ``ModelConfig.is_sparse``)."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.shard = shard
        _, self.inter = shard.part(moe.intermediate_size)
        hidden = cfg.hidden_size
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)  # the router, replicated
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden, self.inter))
        self.shared_expert = (SharedExpert(hidden, moe.shared_expert_intermediate_size, shard)
                              if moe.shared_expert_intermediate_size else None)
        self.router = TopKRouter(moe.top_k, moe.norm_topk_prob)
        self.experts: ExpertsBackend = GroupedExperts()  # the loader picks one for the device

    def use(self, experts: ExpertsBackend) -> None:
        """Run the experts with ``experts`` from now on (it may rewrite the weights' layout)."""
        experts.prepare(self)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(self.gate(x), x.dtype)
        out = self.experts.forward(x, self.w13, self.w2, ids, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.shard.all_reduce(out)
