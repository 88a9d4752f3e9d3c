"""FP8 weights kept resident: linear layers that multiply by a block-scaled e4m3 weight.

Where the device has a block-scaled FP8 GEMM, the loader swaps each linear layer whose weight
comes from FP8 checkpoint tensors in block-aligned parts (a fused QKV or gate/up of parts
that are whole blocks, a tensor-parallel shard on block boundaries) for an ``Fp8Linear``:
the e4m3 weight and its ``weight_scale_inv`` are copied as stored, and every call runs the
GEMM. Weights that cannot stay FP8 (stacked experts, unaligned parts) are dequantized at load
as on CPU (``engine.fp8``).

How the GEMM runs is a ``BlockFp8Gemm`` by name (``GEMMS``):

    dequant    any device: the weight dequantized on every call, then a plain matmul (the
               reference, and the "per matmul" option measured on CPU)
    scaled_mm  CUDA, compute capability 9.x (H100/H200), 128x128 weight blocks:
               ``torch._scaled_mm`` with DeepSeek's scaling: activations quantized on the fly
               per token and 128-column group (``activation_scheme: dynamic``), weights per
               128x128 block

``resident_gemm`` picks one for a device and block size, after checking it on a probe against
the dequantized reference; None (dequantize at load) where none applies or the probe fails.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize

log = logging.getLogger(__name__)

class BlockFp8Gemm(Protocol):
    """``y = x @ dequantize(weight, scale_inv).T``: ``x [M, K]`` (bf16/fp16/fp32), ``weight [N, K]``
    e4m3, ``scale_inv [ceil(N / bn), ceil(K / bk)]`` float32; ``[M, N]`` in ``x``'s dtype.
    ``supports(N, K, block)``: whether it runs a weight of that shape (else the layer dequantizes)."""

    name: str

    def supports(self, out_features: int, in_features: int, block: tuple[int, int]) -> bool: ...

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor: ...


class DequantGemm:
    name = "dequant"

    def supports(self, out_features, in_features, block):
        return True

    def __call__(self, x, weight, scale_inv, block):
        return F.linear(x, dequantize(weight, scale_inv, block, x.dtype))


class ScaledMmGemm:
    name = "scaled_mm"

    def supports(self, out_features, in_features, block):
        # whole blocks only: activations are grouped by the weight's column blocks, and the
        # kernel takes no partial scale blocks (DeepSeek-V3's 576-row kv_a_proj dequantizes)
        return out_features % block[0] == 0 and in_features % block[1] == 0

    def __call__(self, x, weight, scale_inv, block):
        group = block[1]
        m, k = x.shape
        xs = x.float().view(m, k // group, group)
        x_scale = (xs.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)  # [M, K / 128]: per token and group
        xq = (xs / x_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
        # 1x128 scales go in "outer-dim-major" (column-major) layout, 128x128 ones as stored
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale.t().contiguous().t(),
                                scale_b=scale_inv.contiguous(), out_dtype=x.dtype)


GEMMS: dict[str, type] = {"dequant": DequantGemm, "scaled_mm": ScaledMmGemm}


def resident_gemm(device: torch.device, block: tuple[int, int], dtype: torch.dtype) -> BlockFp8Gemm | None:
    """The block-scaled FP8 GEMM to keep weights resident with on ``device``, or None: dequantize
    at load. CUDA 9.x with 128x128 blocks in half precision runs ``scaled_mm`` if it reproduces
    the dequantized matmul on a probe."""
    if device.type != "cuda" or block != (128, 128) or dtype not in (torch.bfloat16, torch.float16):
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    gemm = ScaledMmGemm()
    try:
        ok = probe(gemm, device, dtype)
    except (RuntimeError, TypeError, ValueError) as e:  # a torch or cuBLAS without blockwise scaling
        log.info("block-scaled FP8 GEMMs unavailable (%s): FP8 weights are dequantized at load", e)
        return None
    if not ok:
        log.warning("block-scaled FP8 GEMM disagrees with the dequantized matmul: FP8 weights are dequantized at load")
    return gemm if ok else None


def probe(gemm: BlockFp8Gemm, device: torch.device, dtype: torch.dtype) -> bool:
    """Does ``gemm`` reproduce the dequantized matmul (to FP8 activation rounding) on random data,
    for one row (a decode step) and for many?"""
    g = torch.Generator().manual_seed(0)
    w, scale = quantize(torch.randn(256, 512, generator=g), (128, 128))
    w, scale = w.to(device), scale.to(device)
    for rows in (1, 33):
        x = torch.randn(rows, 512, generator=g).to(device, dtype)
        want = F.linear(x.float(), dequantize(w, scale, (128, 128)))
        got = gemm(x, w, scale, (128, 128)).float()
        if not ((got - want).norm() / want.norm()).item() < 0.05:
            return False
    return True


class Fp8Linear(nn.Module):
    """A linear layer over a resident e4m3 weight ``[out, in]`` and its block scales."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], gemm: BlockFp8Gemm,
                 bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.in_features, self.out_features, self.block, self.gemm = in_features, out_features, block, gemm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        scales = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.bias = bias

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int], gemm: BlockFp8Gemm) -> Fp8Linear:
        """An ``Fp8Linear`` of ``linear``'s shape (its bias kept), to load into."""
        return cls(linear.in_features, linear.out_features, block, gemm, linear.bias, linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.block)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
