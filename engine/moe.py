"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) over a flat token batch.

    x --router--> top-k experts and weights per token --experts backend--> sum_k w * expert_k(x)
      \\--shared expert (Qwen2-MoE: gated by sigmoid(shared_expert_gate(x)); DeepSeek: ungated)--/

How experts are chosen is a router picked by the config's name from ``ROUTERS``:
``softmax`` (``TopKRouter``: Mixtral, Qwen) and ``sigmoid-grouped`` (``GroupedTopKRouter``:
DeepSeek-V3's sigmoid scores, group-limited choice with a correction bias).

Every expert is a SwiGLU MLP; their weights are stacked, ``w13`` ``[E, 2*I, H]`` (each
expert's gate rows, then its up rows: the dense MLP's fused layout) and ``w2`` ``[E, H, I]``.
Under tensor parallelism each rank holds its share of every expert's intermediate dimension
(as the dense MLP does), so the experts' output is a partial sum and one all-reduce per layer
adds them up, shared expert included.

How the chosen experts run is an ``ExpertsBackend`` picked by name from ``EXPERTS``:
``grouped`` (any device: tokens sorted by expert, one matmul pair per expert that has tokens;
no dense all-experts compute; oneDNN-packed on CPU) and ``flashinfer`` (CUDA, half precision:
FlashInfer's fused CUTLASS MoE kernel). ``default_experts`` picks one for a device and dtype;
each layer holds its own instance, which holds the weights in its own layout.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.tp import Shard

PACK_BATCH_HINT = 32  # as engine.model's: oneDNN lays the packed weights out for about this many rows

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


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3's router (``noaux_tc``), with ``TopKRouter``'s contract.

    Scores are ``sigmoid(logits)`` (fp32). The choice adds ``e_score_correction_bias`` (a
    per-expert bias trained to balance load): experts are split into ``num_groups`` groups,
    each group scored by the sum of its best two biased scores, the best ``topk_groups``
    groups kept, and the ``top_k`` best biased scores among their experts chosen. The weights
    are the chosen experts' scores *without* the bias, optionally renormalised to sum to one,
    times ``routed_scaling_factor``. The bias is a parameter (the checkpoint's
    ``mlp.gate.e_score_correction_bias``), kept in fp32 with the router's logits."""

    def __init__(self, num_experts: int, top_k: int, num_groups: int, topk_groups: int, renormalize: bool,
                 scaling: float):
        super().__init__()
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.scaling = renormalize, scaling
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids ``[T, k]`` int64, weights ``[T, k]`` in ``dtype``)"""
        scores = logits.float().sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.num_groups, e // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            keep = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.scaling).to(dtype)


def make_router(moe) -> TopKRouter | GroupedTopKRouter:
    """The router a ``MoeConfig`` names (``ROUTERS``)."""
    try:
        return ROUTERS[moe.router](moe)
    except KeyError:
        raise ValueError(f"unknown MoE router {moe.router!r} (choose from {', '.join(ROUTERS)})") from None


ROUTERS = {
    "softmax": lambda moe: TopKRouter(moe.top_k, moe.norm_topk_prob),
    "sigmoid-grouped": lambda moe: GroupedTopKRouter(moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups,
                                                     moe.norm_topk_prob, moe.routed_scaling_factor),
}


class ExpertsBackend(Protocol):
    """Runs each token's chosen experts of one MoE layer and sums their outputs by the routing weights.

    Contract: ``prepare(moe)`` once, after loading: take the layer's stacked weights (``w13``
    ``[E, 2I, H]``, each expert's gate rows then its up rows; ``w2`` ``[E, H, I]``) into the
    backend's own layout (it may rewrite or repack them; one backend instance per layer).
    ``forward(x [T, H], ids [T, k], weights [T, k])`` returns
    ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = ids[t, j]``,
    ``[T, H]`` in ``x``'s dtype.
    """

    name: str

    def prepare(self, moe: SparseMoE) -> None: ...

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class GroupedExperts:
    """Any device, any dtype: sort the (token, expert) pairs by expert, then for each expert that
    has tokens one gate/up matmul and one down matmul over its contiguous rows; the weighted rows
    are added back onto their tokens. Work is proportional to ``T * k``, never to ``E``.

    On CPU each expert's two matrices are pre-packed for oneDNN, as the dense linears are
    (``engine.model.PackedLinear``: the BLAS would re-pack a plain weight on every call);
    the packed copies then replace the stacked weights."""

    name = "grouped"

    def prepare(self, moe: SparseMoE) -> None:
        self.inter = moe.inter
        self.gate_up = list(moe.w13.unbind(0))
        self.down = list(moe.w2.unbind(0))
        self.linear = F.linear
        if _can_pack(moe.w13):
            self.gate_up = [_pack(w) for w in self.gate_up]
            self.down = [_pack(w) for w in self.down]
            self.linear = _packed_linear
            moe.release_stacked_weights()

    def forward(self, x, ids, weights):
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair j = (token j // k, its (j % k)-th expert)
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()  # one host sync per layer
        tokens = order // k
        xs = x.index_select(0, tokens)
        rows = torch.empty_like(xs)
        inter, start = self.inter, 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = self.linear(xs[start : start + n], self.gate_up[e])
            rows[start : start + n] = self.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down[e])
            start += n
        rows.mul_(weights.reshape(-1, 1).index_select(0, order))
        # pairs are added onto their token in expert order, as the reference implementations do
        return torch.zeros_like(x).index_add_(0, tokens, rows)


def _can_pack(w: torch.Tensor) -> bool:
    """oneDNN serves this CPU dtype and reproduces ``F.linear`` (checked on a random probe)."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    probe, x = torch.randn(24, 40, generator=g).to(w.dtype), torch.randn(3, 40, generator=g).to(w.dtype)
    try:
        return torch.allclose(_packed_linear(x, _pack(probe)).float(), F.linear(x, probe).float(), rtol=1e-2, atol=1e-3)
    except (RuntimeError, AttributeError):  # an op this torch build lacks
        return False


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


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
        self.w31, self.w2 = moe.w13, moe.w2

    def forward(self, x, ids, weights):
        out = torch.empty_like(x)
        result = self._moe(x.contiguous(), ids.to(torch.int32), weights.to(torch.float32), self.w31, self.w2,
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
    """FlashInfer's fused kernel on CUDA in half precision when it is installed, else grouped
    (a new instance: each layer holds its own)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        try:
            return FlashInferExperts()
        except ImportError:
            log.info("flashinfer is not installed: MoE layers run the grouped experts")
    return GroupedExperts()


class SharedExpert(nn.Module):
    """The dense expert every token runs: Qwen2-MoE's scaled per token by a sigmoid gate
    (``gated``), DeepSeek's shared experts (as one, their widths summed) plainly added.
    Column/row-parallel like the dense MLP; its output is a partial sum (the MoE reduces)."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard, gated: bool = True):
        super().__init__()
        _, self.inter = shard.part(intermediate)
        self.gate_up_proj = nn.Linear(hidden, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False) if gated else None  # replicated: every rank scales its part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out


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
        self.shared_expert = (SharedExpert(hidden, moe.shared_expert_intermediate_size, shard, moe.shared_expert_gated)
                              if moe.shared_expert_intermediate_size else None)
        self.router = make_router(moe)
        self.router_dtype: torch.dtype | None = None  # the router's logits in this dtype (None: the model's)
        self.experts: ExpertsBackend | None = None  # the loader gives one (``use``) once the weights are in

    def keep_router_fp32(self) -> None:
        """DeepSeek computes its router's logits, and keeps its correction bias, in fp32 whatever
        the model's dtype (their top-k is a close race): call after the model is cast, before loading."""
        if isinstance(self.router, GroupedTopKRouter):
            self.gate.float()
            self.router.float()
            self.router_dtype = torch.float32

    def use(self, experts: ExpertsBackend) -> None:
        """Run the experts with ``experts`` from now on (it takes the weights into its own layout)."""
        experts.prepare(self)
        self.experts = experts

    def release_stacked_weights(self) -> None:
        """The experts backend holds its own copy of the expert weights: free the stacked ones."""
        for p in (self.w13, self.w2):
            p.data = p.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x if self.router_dtype is None else x.to(self.router_dtype))
        ids, weights = self.router(logits, x.dtype)
        out = self.experts.forward(x, ids, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.shard.all_reduce(out)
