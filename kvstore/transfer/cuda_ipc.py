"""``cuda_ipc``: GPU, same node. The decode worker exports its KV tensor with a
CUDA IPC handle; the prefill worker opens it once and copies its blocks device
to device, straight into the destination blocks (one strided copy per run of
consecutive block ids, as ``shm`` does in host memory).

    decode   params()  {handle, offset, spec, host, pid, device_uuid}   (computed once)
    prefill  usable()  same host, another process, a GPU with that UUID visible here
             send()    open the handle (once per decode worker), copy on a stream of
                       our own, synchronize it: the bytes are in place when it returns
    decode   finish()  True

A handle names a whole cudaMalloc allocation, and PyTorch's caching allocator
may have put the KV tensor inside a larger one, so the descriptor is the pair
(handle of the allocation, byte offset of the tensor in it): what
``torch.multiprocessing`` sends for a CUDA tensor, spelled out instead of
pickled. The memory must come from cudaMalloc: the ``expandable_segments`` and
``cudaMallocAsync`` allocator settings give memory a CUDA IPC handle cannot name.

Who unmaps: the sender closes a decode worker's mapping when that worker's
handle changes (a restart) or its process is gone. The memory itself is the
decode worker's; nothing here frees it.

CuPy (``cupy.cuda.runtime`` for the IPC calls) is imported on first use, so
this module imports on machines without CUDA or CuPy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvstore.cache import KVCache, KVCacheSpec, copy_block_tensor
from kvstore.transfer import (
    TransferResult,
    TransferTarget,
    host_id,
    register_receiver,
    register_sender,
)

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def cupy_module():
    """CuPy, or None where it is missing or cannot load (a CPU machine)."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library CuPy cannot find
        return None
    return cupy


def device_uuid(index: int) -> str:
    """The GPU's UUID: the same in every process, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(index).uuid)


@lru_cache(maxsize=1)
def visible_devices() -> dict[str, int]:
    """UUID -> device index in this process."""
    if not torch.cuda.is_available():
        return {}
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


# -- export (decode side) --------------------------------------------------------


@lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    # CuPy does not wrap cuMemGetAddressRange; the driver library is there wherever a GPU is
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


@contextlib.contextmanager
def _primary_context(index: int):
    """Make the device's primary context (the one the runtime, PyTorch and CuPy use) current on
    this thread. A driver API call needs one, and a thread that never ran CUDA work has none:
    PyTorch and CuPy skip cudaSetDevice when the device is already the current one."""
    lib = _libcuda()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)


def allocation_range(ptr: int, device: int) -> tuple[int, int]:
    """(base, size) of the allocation on ``device`` that holds ``ptr``."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with _primary_context(device):
        rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    _check(rc, "cuMemGetAddressRange")
    return base.value, size.value


def export_tensor(t: torch.Tensor) -> tuple[bytes, int]:
    """(IPC handle of the allocation holding ``t``, byte offset of ``t`` in it)."""
    cupy = cupy_module()
    if cupy is None:
        raise ValueError("the cuda_ipc transport needs CuPy")
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    rt = cupy.cuda.runtime
    with cupy.cuda.Device(t.device.index):
        base, size = allocation_range(ptr, t.device.index)
        try:
            handle = rt.ipcGetMemHandle(base)
        except Exception as e:  # cupy.cuda.runtime.CUDARuntimeError
            raise ValueError(
                f"cannot export the KV cache by CUDA IPC ({e}); the expandable_segments and "
                "cudaMallocAsync settings of PYTORCH_CUDA_ALLOC_CONF give memory IPC cannot share"
            ) from None
    if not (base <= ptr and ptr + nbytes <= base + size):
        raise ValueError("the KV tensor is not inside one device allocation")
    return bytes(handle), ptr - base


@register_receiver("cuda_ipc")
class CudaIpcReceiver:
    name = "cuda_ipc"

    def __init__(self, kv: KVCache, **_):
        if kv.device.type != "cuda":
            raise ValueError("the cuda_ipc transport needs a KV cache on a CUDA device")
        handle, offset = export_tensor(kv.tensor)
        self._params = {
            "handle": handle.hex(), "offset": offset, "spec": kv.spec.to_dict(), "host": host_id(),
            "pid": os.getpid(), "device_uuid": device_uuid(kv.tensor.device.index),
        }

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        return self._params

    async def finish(self, request_id: str) -> bool:
        return True  # the sender synchronized its copy before it sent PrefillDone

    def forget(self, request_id: str) -> None:
        pass

    def revoke(self, request_id: str) -> bool:
        # The sender writes our memory and nothing here can tell when it stops: the blocks wait
        # for its PrefillDone (sent once its copy is synchronized). A fence file as shm's would do.
        return False


# -- import and copy (prefill side) ------------------------------------------------


@dataclass
class _Mapping:
    """A decode worker's KV pool opened in this process."""

    handle: str
    offset: int
    pid: int
    device: int
    base: int  # what cudaIpcOpenMemHandle returned: the start of the exporter's allocation
    tensor: torch.Tensor  # the KV tensor at base + offset, in the decode worker's layout

    def close(self) -> None:
        self.tensor = torch.empty(0)
        cupy = cupy_module()
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.base)


def open_tensor(handle: bytes, offset: int, spec: KVCacheSpec, device: int) -> tuple[int, torch.Tensor]:
    """Map another process's allocation; (its base here, the tensor at ``offset`` shaped by ``spec``)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        # opened in the context of the device that holds the memory: no peer mapping needed
        base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        try:
            mem = cupy.cuda.UnownedMemory(base + offset, spec.total_bytes, handle, device)
            raw = cupy.ndarray((spec.total_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            flat = torch.as_tensor(raw, device=torch.device("cuda", device))
        except BaseException:
            cupy.cuda.runtime.ipcCloseMemHandle(base)
            raise
    return base, flat.view(spec.dtype).view(spec.shape)


@register_sender("cuda_ipc")
class CudaIpcSender:
    name = "cuda_ipc"

    def __init__(self, **_):
        self._maps: dict[str, _Mapping] = {}  # decode worker id -> its pool, opened
        self._streams: dict[int, torch.cuda.Stream] = {}
        # one copy at a time: copies are bandwidth bound anyway, and no mapping closes mid-copy
        self._lock = threading.Lock()

    def usable(self, params: dict) -> bool:
        return (
            params.get("host") == host_id()
            and params.get("pid") != os.getpid()  # a process cannot open its own IPC handle
            and params.get("device_uuid") in visible_devices()
            and cupy_module() is not None
        )

    async def send(self, target: TransferTarget, params: dict, src: KVCache, src_blocks: list[int]) -> TransferResult:
        if src.device.type != "cuda":
            raise ValueError("the cuda_ipc transport copies from a KV cache on a CUDA device")
        spec = KVCacheSpec.from_dict(params["spec"])
        if not src.spec.same_layout(spec):
            raise ValueError("the decode worker's KV layout differs from ours")
        dest = target.dest_block_ids
        if len(src_blocks) != len(dest):
            raise ValueError("source and destination block lists differ in length")
        if dest and not 0 <= min(dest) <= max(dest) < spec.num_blocks:
            raise ValueError("a destination block is outside the decode worker's pool")
        t0 = time.perf_counter()
        await asyncio.to_thread(self._send, target.decode_worker, params, spec, src, src_blocks, dest)
        return TransferResult(self.name, len(src_blocks) * spec.block_bytes, time.perf_counter() - t0)

    def _send(self, worker: str, params: dict, spec: KVCacheSpec, src: KVCache,
              src_ids: list[int], dst_ids: list[int]) -> None:
        with self._lock:
            dst = self._attach(worker, params, spec)
            dev = src.tensor.device
            stream = self._streams.get(dev.index)
            if stream is None:
                stream = self._streams[dev.index] = torch.cuda.Stream(device=dev)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                # the engine wrote the source blocks on the default stream
                stream.wait_stream(torch.cuda.default_stream(dev))
                copy_block_tensor(dst, src.tensor, src_ids, dst_ids)
            stream.synchronize()
            if dst.device != dev:  # a peer copy may finish on the other device's stream
                torch.cuda.synchronize(dst.device)

    def _attach(self, worker: str, params: dict, spec: KVCacheSpec) -> torch.Tensor:
        m = self._maps.get(worker)
        key = (params["handle"], int(params["offset"]), int(params["pid"]))
        if m is not None and (m.handle, m.offset, m.pid) == key:
            return m.tensor
        self._prune(worker)
        device = visible_devices()[params["device_uuid"]]
        base, tensor = open_tensor(bytes.fromhex(params["handle"]), key[1], spec, device)
        self._maps[worker] = _Mapping(key[0], key[1], key[2], device, base, tensor)
        log.info("cuda_ipc: opened the KV pool of %s (pid %d) on cuda:%d", worker, key[2], device)
        return tensor

    def _prune(self, worker: str) -> None:
        """Unmap the pool of ``worker`` (it restarted) and of decode workers whose process is gone."""
        for w in list(self._maps):
            if w == worker or not os.path.exists(f"/proc/{self._maps[w].pid}"):
                m = self._maps.pop(w)
                with contextlib.suppress(Exception):
                    m.close()
