"""``shm``: CPU, same host. The decode worker's KV pool is a file in /dev/shm;
the prefill worker maps it and copies its blocks straight into the destination
blocks (one strided copy per run of consecutive block ids). Nothing to do on
the receiving side: the bytes are in place when the sender says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from kvstore.cache import KVCache, KVCacheSpec
from kvstore.transfer import TransferResult, host_id, register_receiver, register_sender
from mesh.protocol import PrefillJob

SHM_DIR = Path("/dev/shm")
PREFIX = "pdmesh-kv-"


def shm_path(worker_id: str) -> str:
    return str(SHM_DIR / f"{PREFIX}{os.getpid()}-{worker_id}")


def remove_stale_files() -> int:
    """Delete KV files of processes that no longer exist (a killed decode worker leaves one)."""
    removed = 0
    for f in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(f.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                f.unlink()
                removed += 1
    return removed


@register_receiver("shm")
class ShmReceiver:
    name = "shm"

    def __init__(self, kv: KVCache, **_):
        if kv.shm_path is None:
            raise ValueError("the shm transport needs a KV cache in shared memory")
        self._params = {"path": kv.shm_path, "host": host_id(), "spec": kv.spec.to_dict()}

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        return self._params

    async def finish(self, request_id: str) -> bool:
        return True

    def forget(self, request_id: str) -> None:
        pass


@register_sender("shm")
class ShmSender:
    name = "shm"

    def __init__(self, **_):
        self._attached: dict[tuple[str, int], KVCache] = {}

    def usable(self, params: dict) -> bool:
        return params.get("host") == host_id() and os.path.exists(params.get("path", ""))

    def _attach(self, params: dict) -> KVCache:
        path = params["path"]
        key = (path, os.stat(path).st_ino)  # a restarted decode worker is a new file
        kv = self._attached.get(key)
        if kv is None:
            self._prune(keep=key)
            kv = KVCache.attach(KVCacheSpec.from_dict(params["spec"]), path)
            self._attached[key] = kv
        return kv

    def _prune(self, keep: tuple[str, int]) -> None:
        """Unmap files of decode workers that restarted or left (the mapping pins their memory)."""
        for key in list(self._attached):
            if key != keep and (key[0] == keep[0] or not os.path.exists(key[0])):
                self._attached.pop(key).close()

    async def send(self, job: PrefillJob, params: dict, src: KVCache, src_blocks: list[int]) -> TransferResult:
        dst = self._attach(params)
        if not src.spec.same_layout(dst.spec):
            raise ValueError("the decode worker's KV layout differs from ours")
        t0 = time.perf_counter()
        await asyncio.to_thread(src.copy_blocks_to, dst, src_blocks, job.dest_block_ids)
        nbytes = len(src_blocks) * dst.spec.block_bytes
        return TransferResult(self.name, nbytes, time.perf_counter() - t0)
