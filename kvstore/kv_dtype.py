"""A KV cache's dtype (``--kv-cache-dtype``): the engine's own, or FP8, and the casts between them.

FP8 values are stored as they are, with one scale of 1.0 per tensor (vLLM's default without
calibrated scales): a block's bytes mean the same in every worker, so no scale travels with a
block, and a copy between caches of different dtypes is a cast (``to_kv_dtype``, saturating at
FP8's largest value). A scale would not buy precision: a float format's relative precision is
its mantissa's whatever the scale, which only moves the range (e4m3: 2^-6 to 448, where K, V and
MLA latents sit). Block hashes name tokens, never bytes: the dtype is the worker's.
"""

from __future__ import annotations

from functools import cache

import torch

# ``--kv-cache-dtype``, vLLM's values: the cache's dtype, None for the engine's own (``auto``)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, engine_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype name`` in an engine computing in ``engine_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or engine_dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``float8_e4m3fn``, ``bfloat16``: how specs, params and cards name a KV dtype."""
    return str(dtype).removeprefix("torch.")


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *FP8_DTYPES)  # what a KV cache may hold


def parse_dtype(name: object) -> torch.dtype:
    """A KV dtype from its name in a spec or params (``dtype_name``); ValueError for any other."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype


def to_kv_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast for a cache of ``dtype``; into FP8 it saturates at the format's largest finite
    value (a plain cast of a larger one may give NaN or inf, depending on the device)."""
    if t.dtype == dtype:
        return t
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        if t.dtype in FP8_DTYPES:
            t = t.float()  # no clamp kernel for FP8 itself
        return t.clamp(-top, top).to(dtype)
    return t.to(dtype)


def from_kv_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values read from a cache, in ``dtype``. FP8 on CPU goes through a table of its 256 values:
    torch casts FP8 there one element at a time, ~4x slower than the table's gather."""
    if t.dtype == dtype:
        return t
    if t.dtype in FP8_DTYPES and t.device.type == "cpu":
        flat = as_bytes(t.contiguous()).view(-1).int()
        return _fp8_values(t.dtype, dtype).index_select(0, flat).view(t.shape)
    return t.to(dtype)


@cache
def _fp8_values(fp8: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Every value of the FP8 format ``fp8``, by its byte, in ``dtype`` (CPU)."""
    return torch.arange(256, dtype=torch.uint8).view(fp8).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8, for the copies with no FP8 kernel on CPU (``index_copy_``);
    other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t
