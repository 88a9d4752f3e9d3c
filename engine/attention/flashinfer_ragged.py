"""FlashInfer with ragged prefill: the ``flashinfer-ragged`` backend.

The ``flashinfer`` backend runs every prefill and mixed step on the paged prefill
kernel: this step's K/V are written to the pages first and read back from them,
through the page table, with the cached prefix. This one splits a prefill step
the way SGLang's FlashInfer backend does:

* this step's own tokens attend over this step's K/V as a ragged batch (causal,
  no page table): ``BatchPrefillWithRaggedKVCacheWrapper`` on the fresh k, v;
* the sequences with a cached prefix (a prefix hit, or the chunks before this
  one) attend over it from the pages, without a mask (every prefix token comes
  before every query): the paged prefill wrapper, on their rows only;
* the two partial results merge by their log-sum-exp (``flashinfer.merge_state``).

Pure decode steps (and CUDA graphs) are the parent's. The new K/V still go to the
pages, for the steps after. Which is faster for 2k/8k prompts with and without
prefix hits is for ``python -m bench engine-gpu`` to say; ``tests/gpu`` checks it
against the torch backend. Sequences without a prefix are left out of the paged
pass rather than sent with an empty KV range.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBatch, register
from engine.attention.flashinfer_backend import FlashInferAttention, _int32
from engine.hostcopy import to_device
from kvstore.cache import KVCache


class FlashInferRaggedAttention(FlashInferAttention):
    name = "flashinfer-ragged"

    def __init__(self, kv: KVCache, scale: float, kernels: str = "fa2"):
        super().__init__(kv, scale, kernels)
        fi = self._flashinfer
        self._ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD", backend=kernels)
        self._prefix = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=kernels)
        self._merge = fi.merge_state

    def _set_layout(self, batch: AttentionBatch) -> None:
        super()._set_layout(batch)
        if self._pure_decode:
            return
        bs = self.block_size
        prefix_rows: list[int] = []
        p_qo, p_kv, p_indices, p_last = [0], [0], [], []
        row = 0
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            cached = ctx - qlen
            if cached > 0:
                nblk = -(-cached // bs)
                prefix_rows.extend(range(row, row + qlen))
                p_qo.append(p_qo[-1] + qlen)
                p_kv.append(p_kv[-1] + nblk)
                p_indices.extend(table[:nblk])
                p_last.append(cached - (nblk - 1) * bs)
            row += qlen
        self._num_rows = row
        self._has_prefix = bool(prefix_rows)
        self._all_have_prefix = len(prefix_rows) == row
        self._prefix_layout = (_int32(p_qo), _int32(p_kv), to_device(p_indices, torch.int32, self.kv.device),
                               _int32(p_last))
        self._prefix_rows = (None if self._all_have_prefix or not prefix_rows
                             else to_device(prefix_rows, torch.long, self.kv.device))

    def _plan_wrapper(self, num_qo_heads: int, dtype: torch.dtype) -> None:
        if self._pure_decode:
            super()._plan_wrapper(num_qo_heads, dtype)
            return
        common = dict(q_data_type=dtype, kv_data_type=self.kv.spec.dtype, sm_scale=self.scale)
        # this step's tokens over this step's K/V: query and key ranges are the same
        self._ragged.plan(self._qo_indptr, self._qo_indptr, num_qo_heads, self.num_kv_heads, self.head_dim,
                          causal=True, **common)
        if self._has_prefix:
            qo, kv, indices, last = self._prefix_layout
            self._prefix.plan(qo, kv, indices, last, num_qo_heads, self.num_kv_heads, self.head_dim,
                              self.block_size, causal=False, **common)
        self._planned_for = (num_qo_heads, dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._pure_decode or self._active is not None:
            return super().forward(layer, q, k, v)
        k_pages, v_pages = self.kv.layer(layer)
        k_pages.view(-1, self.num_kv_heads, self.head_dim)[self._slots] = k
        v_pages.view(-1, self.num_kv_heads, self.head_dim)[self._slots] = v
        if self._planned_for != (q.shape[1], q.dtype):
            self._plan_wrapper(q.shape[1], q.dtype)
        q = q.contiguous()
        out, lse = self._ragged.run(q, k.contiguous(), v.contiguous(), return_lse=True)
        if not self._has_prefix:
            return out
        rows = self._prefix_rows
        if rows is None:  # every sequence has a prefix: no gather
            o2, s2 = self._prefix.run(q, (k_pages, v_pages), return_lse=True)
            merged, _ = self._merge(out, lse, o2, s2)
            return merged
        o2, s2 = self._prefix.run(q.index_select(0, rows), (k_pages, v_pages), return_lse=True)
        merged, _ = self._merge(out.index_select(0, rows), lse.index_select(0, rows), o2, s2)
        return out.index_copy_(0, rows, merged)


@register("flashinfer-ragged")
def _make(kv: KVCache, scale: float) -> FlashInferRaggedAttention:
    return FlashInferRaggedAttention(kv, scale)
