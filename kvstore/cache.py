"""The KV cache tensor: where the bytes of the block pool live.

Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(layer-major): each layer's K and V are contiguous ``[num_blocks, block_size,
heads, dim]`` pages, the layout paged attention kernels take as is, and the
blocks of a request move between pools (transfer, offload) with one gather
over ``[:, :, block_ids]``.

On CPU the tensor can live in a shared-memory file so that a prefill worker on
the same host writes a decode worker's blocks in place (the ``shm`` transport).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVCacheSpec:
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {d['dtype']!r}")
        return cls(int(d["num_layers"]), int(d["num_blocks"]), int(d["block_size"]),
                   int(d["num_kv_heads"]), int(d["head_dim"]), dtype)

    def same_layout(self, other: KVCacheSpec) -> bool:
        """Blocks of one can be copied into the other (dtype may differ: the copy converts)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim)


class KVCache:
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

    def _map(self, path: str | None, spec: KVCacheSpec, create: bool) -> torch.Tensor:
        size = spec.total_bytes
        if path is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            self._mmap = self._map_file(path, size, create)
        flat = torch.frombuffer(self._mmap, dtype=spec.dtype, count=size // _elem(spec.dtype))
        return flat.view(spec.shape)

    @staticmethod
    def _map_file(path: str, size: int, create: bool) -> mmap.mmap:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared KV file {path} is smaller than its spec says")
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of layer ``i``: each ``[num_blocks, block_size, heads, dim]``."""
        return self.tensor[i, 0], self.tensor[i, 1]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy ``[layers, 2, len(ids), block_size, heads, dim]`` of the given blocks."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        return self.tensor.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.tensor.index_copy_(2, idx, data.to(self.device, self.spec.dtype))

    def read_block_major(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, layers, 2, block_size, heads, dim]``, contiguous: each block's bytes in one piece."""
        return self.read_blocks(block_ids).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_block_major(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.write_blocks(block_ids, data.permute(1, 2, 0, 3, 4, 5))

    def copy_blocks_to(self, dst: KVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy blocks into another cache in place, one strided copy per run of consecutive ids."""
        if len(src_ids) != len(dst_ids):
            raise ValueError("source and destination block lists differ in length")
        for s0, d0, n in block_runs(src_ids, dst_ids):
            dst.tensor[:, :, d0 : d0 + n].copy_(self.tensor[:, :, s0 : s0 + n])

    def close(self, unlink: bool = False) -> None:
        self.tensor = torch.empty(0)
        if self._mmap is not None:
            # a view may still be alive somewhere; then the mapping goes when it does
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if unlink and self.shm_path:
            Path(self.shm_path).unlink(missing_ok=True)


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


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
