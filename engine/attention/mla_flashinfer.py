"""FlashInfer's MLA paged attention: the CUDA latent backend (``flashinfer``).

``flashinfer.mla.BatchMLAPagedAttentionWrapper`` runs the absorbed form for decode and for
causal prefill chunks alike, reading the latent pages in place: the cache's one plane per
layer, ``[blocks, block_size, 1, C + R]``, is handed over as two strided views, ``ckv``
(its first C values) and ``kpe`` (the last R), the layout SGLang passes too. One plan per
step serves every layer (the page table is per sequence, not per layer). FlashInfer's MLA
kernels are built for DeepSeek's dimensions (``HEAD_DIMS``: C 512, R 64) in half precision;
other shapes run the torch backend (``default_backend``).

Not run on CPU machines: ``tests/gpu/test_mla_flashinfer.py`` checks it against the torch
latent backend on a device.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBatch, register_latent
from engine.hostcopy import to_device
from kvstore.cache import KVCache

HEAD_DIMS = ((512, 64),)  # (ckv, kpe) FlashInfer's MLA kernels are built and tested for
DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended size for the split-k partial results


def supports(value_dim: int, rope_dim: int, dtype: torch.dtype) -> bool:
    return (value_dim, rope_dim) in HEAD_DIMS and dtype in DTYPES


class FlashInferLatentAttention:
    name = "flashinfer"

    def __init__(self, kv: KVCache, scale: float, value_dim: int, kernels: str = "auto"):
        import flashinfer  # lazily: CPU machines have none

        spec = kv.spec
        rope_dim = spec.head_dim - value_dim
        if kv.device.type != "cuda":
            raise ValueError(f"the flashinfer latent backend needs a CUDA KV cache, got {kv.device}")
        if not supports(value_dim, rope_dim, spec.dtype):
            raise ValueError(f"flashinfer's MLA kernels serve (latent, rope) dims {HEAD_DIMS} in float16/bfloat16; "
                             f"this model has ({value_dim}, {rope_dim}) in {str(spec.dtype).removeprefix('torch.')} "
                             "(use the torch attention backend)")
        self.kv, self.scale, self.value_dim = kv, scale, value_dim
        self.block_size = spec.block_size
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace, backend=kernels)
        self._planned_for: tuple[int, torch.dtype] | None = None

    def plan(self, batch: AttentionBatch) -> None:
        bs = self.block_size
        qo_indptr, kv_indptr, indices, kv_lens = [0], [0], [], []
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            nblk = -(-ctx // bs)
            indices.extend(table[:nblk])
            qo_indptr.append(qo_indptr[-1] + qlen)
            kv_indptr.append(kv_indptr[-1] + nblk)
            kv_lens.append(ctx)
        self._layout = (torch.tensor(qo_indptr, dtype=torch.int32), torch.tensor(kv_indptr, dtype=torch.int32),
                        to_device(indices, torch.int32, self.kv.device), torch.tensor(kv_lens, dtype=torch.int32))
        self._causal = not batch.is_pure_decode  # a decode row sees its whole context either way
        self._slots = batch.slot_mapping
        self._planned_for = None  # planned at the step's first forward, where the heads are known

    def forward(self, layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        pages = self.kv.latent(layer)  # [blocks, block_size, 1, C + R]
        flat = pages.view(-1, pages.shape[-1])
        flat[self._slots] = latent
        if self._planned_for != (q.shape[1], q.dtype):
            qo, kv_indptr, indices, kv_lens = self._layout
            self._wrapper.plan(qo, kv_indptr, indices, kv_lens, q.shape[1], self.value_dim,
                               pages.shape[-1] - self.value_dim, self.block_size, self._causal, self.scale,
                               q.dtype, self.kv.spec.dtype)
            self._planned_for = (q.shape[1], q.dtype)
        paged = pages.squeeze(2)  # [blocks, block_size, C + R]
        c = self.value_dim
        return self._wrapper.run(q[..., :c], q[..., c:], paged[..., :c], paged[..., c:])


@register_latent("flashinfer")
def _make(kv: KVCache, scale: float, value_dim: int) -> FlashInferLatentAttention:
    return FlashInferLatentAttention(kv, scale, value_dim)
