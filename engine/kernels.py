"""The model's fusable operations, each selectable: plain PyTorch (every device, the reference)
or a fused FlashInfer kernel (CUDA).

    name           plain PyTorch (kernels per layer)           FlashInfer
    add_rmsnorm    residual add + fp32 RMSNorm (~6)            norm.fused_add_rmsnorm (1, in place)
    silu_and_mul   split, silu, mul (2-3)                      activation.silu_and_mul (1)
    rope           rotate-half on q and k (~6)                 rope.apply_rope_with_cos_sin_cache_inplace (1,
                                                               in place on the fused qkv output the
                                                               attention backend appends to the cache)
    sampling       sort-based top-k/top-p + multinomial        sampling.top_k_top_p_sampling_from_logits
                                                               (rejection sampling, no sort)

``Kernels.select(names)`` builds the set: the named operations run FlashInfer's kernel, the rest
PyTorch. Every engine starts with none selected (``EngineConfig.fused_kernels``,
``--fused-kernels``) until a GPU run shows which ones pay; ``tests/gpu/test_fused_kernels.py``
checks each against the plain path. FlashInfer is imported only when a kernel is selected.

The signatures follow FlashInfer 0.6 (the wheel ``scripts/fetch_gpu_wheels.sh`` fetches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FUSED_KERNELS = ("add_rmsnorm", "silu_and_mul", "rope", "sampling")


# -- plain PyTorch --------------------------------------------------------------------------


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does it: normalize in fp32, cast back, then scale.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def torch_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x): the pre-norm of the next block and the new stream."""
    residual = residual + x
    return torch_rmsnorm(residual, weight, eps), residual


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class TorchRope:
    """One step's rotary embedding in the rotate-half convention of HF Llama: cos and sin
    ``[T, 1, head_dim]`` looked up once per step, shared by every layer."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype):
        self.cos = cos_table[positions].unsqueeze(1).to(dtype)
        self.sin = sin_table[positions].unsqueeze(1).to(dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated (a new tensor)."""
        return apply_rotary(x, self.cos, self.sin)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q), self.rotate(k)

    def rotate_fused(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as adjacent heads of one tensor ``[T, Hq + Hkv, D]``: one rotation for both."""
        qk = self.rotate(qk)
        return qk[:, :num_q_heads], qk[:, num_q_heads:]


# -- FlashInfer -------------------------------------------------------------------------------


def _flashinfer():
    import flashinfer  # lazily: CPU machines have none

    return flashinfer


def flashinfer_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # In place: residual += x, then x = RMSNorm(residual) * weight. Both are this step's own
    # activations (the o_proj/down_proj output and the stream), read by nothing else afterwards.
    _flashinfer().norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def flashinfer_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _flashinfer().activation.silu_and_mul(x)


class FlashInferRope:
    """Rotates q and k in place in one kernel, reading a float32 ``[max_pos, D]`` cos|sin table."""

    def __init__(self, cos_sin_cache: torch.Tensor, positions: torch.Tensor):
        self.cache = cos_sin_cache
        self.positions = positions
        self.head_dim = cos_sin_cache.shape[1]
        self._apply = _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q, k: [T, H, D] with a contiguous last dimension (views of the qkv output are fine:
        # the kernel takes the row and head strides)
        self._apply(self.positions, q, k, self.head_dim, self.cache, is_neox=True)
        return q, k

    def rotate_fused(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate_qk(qk[:, :num_q_heads], qk[:, num_q_heads:])


def flashinfer_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` (already divided by the temperature) from the
    top-k then top-p filtered softmax; ``top_k`` of V means no top-k."""
    tokens = _flashinfer().sampling.top_k_top_p_sampling_from_logits(
        logits, top_k, top_p, filter_apply_order="top_k_first", deterministic=True, generator=generator,
    )
    return tokens.long()


# -- the set ----------------------------------------------------------------------------------

RopeFactory = Callable[[torch.nn.Module, torch.Tensor, torch.dtype], object]


def _torch_rope(rotary, positions: torch.Tensor, dtype: torch.dtype) -> TorchRope:
    return TorchRope(rotary.cos, rotary.sin, positions, dtype)


def _flashinfer_rope(rotary, positions: torch.Tensor, dtype: torch.dtype) -> FlashInferRope:
    return FlashInferRope(rotary.cos_sin_cache(), positions)


@dataclass(frozen=True)
class Kernels:
    names: frozenset[str]  # the operations on fused kernels
    add_rmsnorm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope: RopeFactory
    top_k_top_p: Callable[..., torch.Tensor] | None  # None: the sampler's PyTorch path

    @classmethod
    def select(cls, names: tuple[str, ...] | frozenset[str] = ()) -> Kernels:
        chosen = frozenset(names)
        unknown = chosen - set(FUSED_KERNELS)
        if unknown:
            raise ValueError(f"unknown fused kernel(s) {', '.join(sorted(unknown))} "
                             f"(choose from {', '.join(FUSED_KERNELS)})")
        if chosen:
            try:
                _flashinfer()
            except ImportError as e:
                raise ValueError(f"fused kernels ({', '.join(sorted(chosen))}) need flashinfer: {e}") from None
        impl = {name: _IMPLS[name][name in chosen] for name in FUSED_KERNELS}
        return cls(names=chosen, add_rmsnorm=impl["add_rmsnorm"], silu_and_mul=impl["silu_and_mul"],
                   rope=impl["rope"], top_k_top_p=impl["sampling"])


# name -> (plain, fused)
_IMPLS: dict[str, tuple] = {
    "add_rmsnorm": (torch_add_rmsnorm, flashinfer_add_rmsnorm),
    "silu_and_mul": (torch_silu_and_mul, flashinfer_silu_and_mul),
    "rope": (_torch_rope, _flashinfer_rope),
    "sampling": (None, flashinfer_top_k_top_p),
}

PLAIN = Kernels.select()


def parse_fused_kernels(text: str) -> tuple[str, ...]:
    """``--fused-kernels`` value: a comma list of names, ``all``, or ``none``/empty."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "all":
        return FUSED_KERNELS
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FUSED_KERNELS]
    if unknown:
        raise ValueError(f"unknown fused kernel(s) {', '.join(unknown)} (choose from {', '.join(FUSED_KERNELS)}, all)")
    return names
