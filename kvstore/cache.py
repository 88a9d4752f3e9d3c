"""The KV cache tensor: where the bytes of the block pool live.

Layout ``[num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim]``
(layer-major). A plane is one cached vector per token and head: two planes, K and V, for
the attention of every family but one; one plane for multi-head latent attention (MLA,
DeepSeek-V3), whose cache holds one latent vector per token (``num_kv_heads`` 1,
``head_dim`` the latent and rope-key values). Each layer's planes are contiguous
``[num_blocks, block_size, heads, dim]`` pages, the layout paged attention kernels take as
is, and the blocks of a request move between pools (transfer, offload) with one gather over
``[:, :, block_ids]``. Whatever copies blocks takes their shape and bytes from the spec
(``block_shape``, ``block_bytes``), never from an assumed K/V pair.

On CPU the tensor can live in a shared-memory file so that a prefill worker on
the same host writes a decode worker's blocks in place (the ``shm`` transport).

A worker of several ranks shards its KV: a tensor-parallel rank holds its share of
the heads, a pipeline stage the layers it runs. Each rank holds a ``KVCache`` of its
part, and rank 0 sees the whole (every layer, every head) as a ``ShardedKVCache`` over
all of them: a grid of parts, each a range of layers by a range of heads. Both offer
the same whole-block operations, and ``copy_blocks`` copies between any two of them,
re-sharding layers and heads when the layouts differ.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

KV_PLANES = 2  # K and V
LATENT_PLANES = 1  # MLA's latent vector (with its rope key)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_planes: int = KV_PLANES

    def __post_init__(self) -> None:
        if self.num_planes not in (KV_PLANES, LATENT_PLANES):
            raise ValueError(f"a KV cache has 1 (latent) or 2 (K, V) planes, not {self.num_planes}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_planes, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block in the block-major layout the transports and tiers move: ``[layers, planes,
        block_size, heads, dim]``."""
        return (self.num_layers, self.num_planes, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and planes."""
        return (self.num_planes * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * _elem(self.dtype))

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."), "num_planes": self.num_planes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVCacheSpec:
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {d['dtype']!r}")
        # a spec written before planes were part of it is K/V
        return cls(int(d["num_layers"]), int(d["num_blocks"]), int(d["block_size"]),
                   int(d["num_kv_heads"]), int(d["head_dim"]), dtype, int(d.get("num_planes", KV_PLANES)))

    def same_layout(self, other: KVCacheSpec) -> bool:
        """Blocks of one can be copied into the other (dtype may differ: the copy converts)."""
        return (self.num_layers, self.num_planes, self.block_size, self.num_kv_heads, self.head_dim) == (
            other.num_layers, other.num_planes, other.block_size, other.num_kv_heads, other.head_dim)


def map_file(path: str, size: int, create: bool) -> mmap.mmap:
    """A shared-memory KV file mapped shared: created (sparse, ``size`` bytes) or opened."""
    # never through a symlink: a file planted in place of ours must not get our KV bytes
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"shared KV file {path} is smaller than its spec says")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class _BlockIO:
    """Whole-block reads and writes in the block-major layout the transports send."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        raise NotImplementedError

    def parts(self) -> list[KVPart]:
        """Every part of the pool (its layer and head ranges, and the cache that holds it), in rank order."""
        raise NotImplementedError

    def read_block_major(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, *spec.block_shape]``, contiguous: each block's bytes in one piece."""
        return self.read_blocks(block_ids).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_block_major(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.write_blocks(block_ids, data.permute(1, 2, 0, 3, 4, 5))

    def copy_blocks_to(self, dst: _BlockIO, src_ids: list[int], dst_ids: list[int]) -> None:
        copy_blocks(self, dst, src_ids, dst_ids)


class KVCache(_BlockIO):
    """Owns the KV tensor; hands out per-layer views and whole-block copies."""

    def __init__(self, spec: KVCacheSpec, device: torch.device, shm_path: str | None = None):
        self.spec = spec
        self.device = device
        self.shm_path = shm_path
        self._mmap: mmap.mmap | None = None
        if device.type == "cpu":
            # mmap'd pages are zero and cost nothing until touched, shared or not
            self.tensor = self._map(shm_path, spec, create=True)
        elif shm_path is not None:
            raise ValueError("a shared-memory KV cache lives in host memory; use device cpu")
        else:
            self.tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)

    @classmethod
    def attach(cls, spec: KVCacheSpec, shm_path: str) -> KVCache:
        """Map another process's shared-memory KV cache (the prefill side of the shm transport)."""
        self = cls.__new__(cls)
        self.spec = spec
        self.device = torch.device("cpu")
        self.shm_path = shm_path
        self._mmap = None
        self.tensor = self._map(shm_path, spec, create=False)
        return self

    @classmethod
    def attach_fd(cls, spec: KVCacheSpec, fd: int, shm_path: str) -> KVCache:
        """Map an already opened (and checked) KV file; the caller keeps and closes ``fd``."""
        self = cls.__new__(cls)
        self.spec = spec
        self.device = torch.device("cpu")
        self.shm_path = shm_path
        self._mmap = mmap.mmap(fd, spec.total_bytes)
        flat = torch.frombuffer(self._mmap, dtype=spec.dtype, count=spec.total_bytes // _elem(spec.dtype))
        self.tensor = flat.view(spec.shape)
        return self

    @classmethod
    def of_tensor(cls, spec: KVCacheSpec, tensor: torch.Tensor) -> KVCache:
        """Wrap a KV tensor that lives elsewhere (another rank's, opened by CUDA IPC)."""
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"KV tensor of shape {tuple(tensor.shape)}, its spec says {spec.shape}")
        self = cls.__new__(cls)
        self.spec, self.device, self.shm_path, self._mmap, self.tensor = spec, tensor.device, None, None, tensor
        return self

    def _map(self, path: str | None, spec: KVCacheSpec, create: bool) -> torch.Tensor:
        size = spec.total_bytes
        if path is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            self._mmap = map_file(path, size, create)
        flat = torch.frombuffer(self._mmap, dtype=spec.dtype, count=size // _elem(spec.dtype))
        return flat.view(spec.shape)


    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of layer ``i``: each ``[num_blocks, block_size, heads, dim]``."""
        if self.spec.num_planes != KV_PLANES:
            raise ValueError("this KV cache holds latent vectors (MLA), not K and V: use latent()")
        return self.tensor[i, 0], self.tensor[i, 1]

    def latent(self, i: int) -> torch.Tensor:
        """The latent pages of layer ``i`` (MLA): ``[num_blocks, block_size, 1, latent dim]``."""
        if self.spec.num_planes != LATENT_PLANES:
            raise ValueError("this KV cache holds K and V per head, not latent vectors: use layer()")
        return self.tensor[i, 0]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy ``[layers, planes, len(ids), block_size, heads, dim]`` of the given blocks."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        return self.tensor.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.tensor.index_copy_(2, idx, data.to(self.device, self.spec.dtype))

    def parts(self) -> list[KVPart]:
        return [KVPart((0, self.spec.num_layers), (0, self.spec.num_kv_heads), self)]

    def close(self, unlink: bool = False) -> None:
        self.tensor = torch.empty(0)
        if self._mmap is not None:
            # a view may still be alive somewhere; then the mapping goes when it does
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if unlink and self.shm_path:
            Path(self.shm_path).unlink(missing_ok=True)


class KVPart(NamedTuple):
    """One rank's part of a sharded pool: layers ``[lo, hi)`` by heads ``[lo, hi)``, held by ``cache``."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    cache: KVCache


class ShardedKVCache(_BlockIO):
    """A worker's KV over its ranks, as its rank 0 sees it: one ``KVCache`` per rank, in rank
    order (stage-major): the ``tp`` caches of a pipeline stage hold its layers (those after the
    stage before's), each its share of the heads (rank r's after rank r-1's). Block ids are the
    same on every rank. Reads gather the parts, writes scatter them, so a transport sees one
    whole cache whatever the layout. There is no single ``tensor``: per-layer views are each
    rank's own business.
    """

    def __init__(self, shards: list[KVCache], tp: int | None = None):
        tp = tp or len(shards)
        if len(shards) % tp:
            raise ValueError(f"{len(shards)} KV shards are not whole stages of {tp}")
        first = shards[0].spec
        if any(replace(s.spec, num_kv_heads=first.num_kv_heads, num_layers=first.num_layers) != first
               for s in shards):
            raise ValueError("KV shards differ in more than their layers and heads")
        self.shards = shards
        self._parts: list[KVPart] = []
        layer, stage_heads = 0, set()
        for stage in range(len(shards) // tp):
            group = shards[stage * tp:(stage + 1) * tp]
            if any(s.spec.num_layers != group[0].spec.num_layers for s in group):
                raise ValueError("the KV shards of one stage hold different layers")
            head = 0
            for s in group:
                self._parts.append(KVPart((layer, layer + s.spec.num_layers), (head, head + s.spec.num_kv_heads), s))
                head += s.spec.num_kv_heads
            layer += group[0].spec.num_layers
            stage_heads.add(head)
        if len(stage_heads) != 1:
            raise ValueError("the stages' KV shards hold different heads")
        self.spec = replace(first, num_kv_heads=stage_heads.pop(), num_layers=layer)
        self.device = shards[0].device
        self.shm_path = shards[0].shm_path

    @property
    def tensor(self) -> torch.Tensor:
        raise AttributeError("a sharded KV cache has one tensor per rank (parts()); "
                             "this user of it does not support --tp or --pp > 1 yet")

    def parts(self) -> list[KVPart]:
        return list(self._parts)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        stages: dict[tuple[int, int], list[torch.Tensor]] = {}
        for p in self._parts:
            stages.setdefault(p.layers, []).append(p.cache.read_blocks(block_ids).to(self.device))
        return torch.cat([torch.cat(heads, dim=4) for heads in stages.values()], dim=0)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        for (l0, l1), (h0, h1), s in self._parts:
            s.write_blocks(block_ids, data[l0:l1, :, :, :, h0:h1])

    def close(self, unlink: bool = False) -> None:
        for s in self.shards:
            s.close(unlink=unlink)


def copy_blocks(src: _BlockIO, dst: _BlockIO, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy whole blocks between two caches of the same layout, in place, whatever the sharding
    of either side (heads over TP ranks, layers over pipeline stages): one strided copy per
    (source part, destination part) overlap and run of consecutive ids. Unsharded to
    unsharded is one copy per run."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("source and destination block lists differ in length")
    if (src.spec.num_kv_heads, src.spec.num_layers) != (dst.spec.num_kv_heads, dst.spec.num_layers):
        raise ValueError("source and destination caches hold different layers or heads")
    if src.spec.num_planes != dst.spec.num_planes:
        raise ValueError("source and destination caches hold different planes (K/V against latent)")
    runs = block_runs(src_ids, dst_ids)
    for d in dst.parts():
        for s in src.parts():
            layers, heads = _overlap(d.layers, s.layers), _overlap(d.heads, s.heads)
            if layers is None or heads is None:
                continue
            (l0, l1), (h0, h1) = layers, heads
            copy_block_tensor(d.cache.tensor[l0 - d.layers[0]:l1 - d.layers[0], :, :, :, h0 - d.heads[0]:h1 - d.heads[0]],
                              s.cache.tensor[l0 - s.layers[0]:l1 - s.layers[0], :, :, :, h0 - s.heads[0]:h1 - s.heads[0]],
                              src_ids, dst_ids, runs)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


# On a GPU a strided copy per run is a kernel launch per run, and scattered blocks make
# one run each; past this many runs the blocks move by index instead.
MAX_CUDA_RUNS = 8
GATHER_BYTES = 256 << 20  # the staging buffer of an indexed copy: this many bytes of layers at a time


def copy_block_tensor(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                      runs: list[tuple[int, int, int]] | None = None, indexed: bool | None = None) -> None:
    """Copy blocks (dim 2 of the ``[layers, planes, blocks, ...]`` layout) between two KV tensors.

    One strided copy per run of consecutive ids; on CUDA, with many short runs (a
    fragmented pool), an index gather and scatter per group of layers instead: a few
    large kernels rather than one small one per block (``indexed`` forces either way).
    """
    runs = block_runs(src_ids, dst_ids) if runs is None else runs
    if indexed is None:
        indexed = dst.device.type == "cuda" and len(runs) > MAX_CUDA_RUNS
    if not indexed:
        for s0, d0, n in runs:
            dst[:, :, d0 : d0 + n].copy_(src[:, :, s0 : s0 + n])
        return
    src_idx = torch.as_tensor(src_ids, dtype=torch.long).to(src.device, non_blocking=True)
    dst_idx = torch.as_tensor(dst_ids, dtype=torch.long).to(dst.device, non_blocking=True)
    layer_bytes = len(src_ids) * src[0, :, 0].numel() * src.element_size()
    step = max(1, GATHER_BYTES // max(1, layer_bytes))
    for l0 in range(0, src.shape[0], step):
        gathered = src[l0 : l0 + step].index_select(2, src_idx).to(dst.device, dst.dtype, non_blocking=True)
        dst[l0 : l0 + step].index_copy_(2, dst_idx, gathered)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both id lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@cache
def _elem(dtype: torch.dtype) -> int:
    """Bytes per element (cached: a tensor made to ask costs ~10-20 us, and a transfer asks per job)."""
    return torch.empty((), dtype=dtype).element_size()
