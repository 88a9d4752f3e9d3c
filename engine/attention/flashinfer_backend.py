"""FlashInfer paged attention: the CUDA backend.

Why it is built this way:

* The cache is read in place. ``kv.layer(i)`` is FlashInfer's ``NHD`` page
  layout (``[blocks, block_size, heads, dim]``), so each layer's K and V pages
  go to the kernels as a tuple: no copy, no layout change.
* One plan per step, shared by every layer. ``plan()`` turns the block tables
  into FlashInfer's CSR page table (``indptr``, ``indices``, last-page lengths)
  on the host, because FlashInfer's own plan reads ``indptr`` and the last-page
  lengths on the host anyway; the page indices go to the device at once, by a
  non-blocking copy (nothing in a step may wait for the step before it). The wrapper itself is planned at the step's
  first ``forward``, where the query heads and dtype are known (the factory
  gets only the cache and the scale).
* Two wrappers. A step of decodes only (one query token per sequence) goes to
  the decode wrapper, on tensor cores so that a GQA group shares each K/V tile;
  any other step, mixed ones included, goes to the prefill wrapper with a
  causal mask. FlashInfer aligns that mask to the end of each sequence's KV, so
  a chunk after a cached prefix sees the whole prefix and a decode row its whole
  context.
* Both wrappers run the FA2 kernels. FlashInfer compiles them with nvcc on
  first use; one FA2 module per (dtype, head_dim) serves both wrappers, where
  ``auto`` would also build FA3 for prefill on Hopper (and may pick cuDNN for
  decode in 0.7): minutes more of nvcc on every fresh machine. ``kernels=`` on
  the constructor overrides this.
* New K/V are scattered by index assignment into the flat slot view of the
  pages, the same slots the torch backend writes. An FP8 cache (``--kv-cache-dtype``) is
  written saturated, as bytes, and both wrappers are planned with ``kv_data_type`` FP8: the
  kernels dequantize as they load (scales 1.0, ``kvstore.cache``), queries stay half precision.
* CUDA graphs (``engine.cuda_graphs``): a decode step padded to a fixed
  batch size runs on that size's own decode wrapper in FlashInfer's
  ``use_cuda_graph`` mode, whose page table lives in fixed buffers that
  ``plan_graph`` refills before each replay.
* ``flashinfer`` is imported when a backend is made, so this module imports,
  and registers, on machines without it.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBatch, register
from engine.hostcopy import to_device
from kvstore.cache import KVCache
from kvstore.kv_dtype import FP8_DTYPES, as_bytes, to_kv_dtype

# FA2 needs head_dim >= 64 (four 16-wide MMA tiles); these are the sizes FlashInfer ships and tests.
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (*DTYPES, *FP8_DTYPES)  # an FP8 cache (--kv-cache-dtype) under half-precision queries
WORKSPACE_BYTES = 256 << 20  # split-KV partial results; FlashInfer recommends 128 MB or more


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this backend can serve a model with these KV heads (for backend selection)."""
    return head_dim in HEAD_DIMS and dtype in DTYPES


class FlashInferAttention:
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, kv: KVCache, scale: float, kernels: str = "fa2"):
        import flashinfer  # lazily: CPU machines and CI have no flashinfer

        spec = kv.spec
        if kv.device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA KV cache, got {kv.device}")
        if spec.head_dim not in HEAD_DIMS or spec.dtype not in KV_DTYPES:
            raise ValueError(
                f"flashinfer serves head_dim {HEAD_DIMS} in float16/bfloat16 (or an FP8 cache); this model has "
                f"head_dim {spec.head_dim} in {str(spec.dtype).removeprefix('torch.')} "
                "(use the torch attention backend)"
            )
        self.kv = kv
        self.scale = scale
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        # One float workspace for every wrapper: a step uses only one of them.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.device)
        self._kernels = kernels
        self._flashinfer = flashinfer
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=kernels
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend=kernels
        )
        self._planned_for: tuple[int, torch.dtype] | None = None
        self._q_layout: tuple[int, torch.dtype] | None = None  # configure(): plan in plan(), not at layer 0
        self._graph_wrappers: dict[int, tuple] = {}  # padded batch size -> (CUDA-graph decode wrapper, pages)
        self._active = None  # the wrapper this step runs on, when it was planned by plan_graph

    def configure(self, num_qo_heads: int, q_dtype: torch.dtype) -> None:
        """The model's query heads and dtype: ``plan`` then plans the wrapper itself, so that a
        step's host work (and its copies out of pinned buffers) is done before its first layer."""
        self._q_layout = (num_qo_heads, q_dtype)

    def plan(self, batch: AttentionBatch) -> None:
        self._set_layout(batch)
        self._planned_for = None  # unless configured, the wrapper is planned at this step's first forward
        self._active = None
        if self._q_layout is not None:
            self._plan_wrapper(*self._q_layout)

    def plan_graph(self, batch: AttentionBatch, num_qo_heads: int, dtype: torch.dtype) -> bool:
        """Plan a pure decode step on the CUDA-graph wrapper of its (padded) batch size.

        True when that wrapper is new: its buffers moved, and a graph captured on the old one
        must be captured again. Sequences sharing cached blocks list them once each, so a step
        can hold more pages than the pool has blocks; the page buffer grows when it must.
        """
        self._set_layout(batch)
        size, pages = len(batch.query_lens), len(self._indices)
        wrapper, capacity = self._graph_wrappers.get(size, (None, 0))
        fresh = pages > capacity
        if fresh:
            capacity = max(2 * pages, self.kv.spec.num_blocks + size)
            dev = self.kv.device
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(capacity, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=dev),
                backend=self._kernels,
            )
            self._graph_wrappers[size] = (wrapper, capacity)
        self._plan_decode(wrapper, num_qo_heads, dtype)
        self._active = wrapper
        return fresh

    def _set_layout(self, batch: AttentionBatch) -> None:
        bs = self.block_size
        qo_indptr, kv_indptr, indices, last_page_len = [0], [0], [], []
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            nblk = -(-ctx // bs)
            indices.extend(table[:nblk])
            qo_indptr.append(qo_indptr[-1] + qlen)
            kv_indptr.append(kv_indptr[-1] + nblk)
            last_page_len.append(ctx - (nblk - 1) * bs)
        self._qo_indptr = _int32(qo_indptr)
        self._kv_indptr = _int32(kv_indptr)
        # On the device already: FlashInfer's plan copies host page indices into its CUDA-graph
        # buffer with a blocking copy (a stream sync, which would wait for the step in flight).
        self._indices = to_device(indices, torch.int32, self.kv.device)
        self._last_page_len = _int32(last_page_len)
        self._pure_decode = batch.is_pure_decode
        self._slots = batch.slot_mapping

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pages, v_pages = self.kv.layer(layer)
        self.write(k_pages, v_pages, k, v)
        if self._active is not None:  # planned by plan_graph (maybe being captured: no host work here)
            return self._active.run(q.contiguous(), (k_pages, v_pages))
        if self._planned_for != (q.shape[1], q.dtype):
            self._plan_wrapper(q.shape[1], q.dtype)
        wrapper = self._decode if self._pure_decode else self._prefill
        return wrapper.run(q.contiguous(), (k_pages, v_pages))

    def write(self, k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V into the pages at its slots, in the cache's dtype (FP8: saturated, as bytes)."""
        kv_dtype, shape = self.kv.spec.dtype, (-1, self.num_kv_heads, self.head_dim)
        as_bytes(k_pages).view(shape)[self._slots] = as_bytes(to_kv_dtype(k, kv_dtype))
        as_bytes(v_pages).view(shape)[self._slots] = as_bytes(to_kv_dtype(v, kv_dtype))

    def _plan_wrapper(self, num_qo_heads: int, dtype: torch.dtype) -> None:
        if self._pure_decode:
            self._plan_decode(self._decode, num_qo_heads, dtype)
        else:
            # Positional up to page_size: the names differ between the wrappers and across versions.
            self._prefill.plan(
                self._qo_indptr, self._kv_indptr, self._indices, self._last_page_len,
                num_qo_heads, self.num_kv_heads, self.head_dim, self.block_size,
                causal=True, q_data_type=dtype, kv_data_type=self.kv.spec.dtype, sm_scale=self.scale,
            )
        self._planned_for = (num_qo_heads, dtype)

    def _plan_decode(self, wrapper, num_qo_heads: int, dtype: torch.dtype) -> None:
        wrapper.plan(
            self._kv_indptr, self._indices, self._last_page_len,
            num_qo_heads, self.num_kv_heads, self.head_dim, self.block_size,
            q_data_type=dtype, kv_data_type=self.kv.spec.dtype, sm_scale=self.scale,
        )


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@register("flashinfer")
def _make(kv: KVCache, scale: float) -> FlashInferAttention:
    return FlashInferAttention(kv, scale)
