"""``shm``: CPU, same host. The decode worker's KV pool is a file in /dev/shm;
the prefill worker maps it and copies its blocks straight into the destination
blocks (one strided copy per run of consecutive block ids). Nothing to do on
the receiving side: the bytes are in place when the sender says so.

Tensor parallelism: a TP decode worker's pool is one file per rank, each with
that rank's heads; its params list them (``shards``: path and head range,
``spec`` for the full head set). The sender maps them all and copies each
overlap of its own shards' heads with theirs (``copy_blocks``), so a prefill
worker of any TP degree feeds a decode worker of any other.

    params  {"path", "host", "spec"}                    one file (TP 1, as before)
            + {"shards": [{"path", "heads": [lo, hi]}]}  one file per rank (TP > 1)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, copy_blocks
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

    def __init__(self, kv: KVCache | ShardedKVCache, **_):
        shards = kv.head_shards()
        if any(shard.shm_path is None for _, _, shard in shards):
            raise ValueError("the shm transport needs a KV cache in shared memory")
        self._params = {"path": shards[0][2].shm_path, "host": host_id(), "spec": kv.spec.to_dict()}
        if len(shards) > 1:
            self._params["shards"] = [{"path": s.shm_path, "heads": [lo, hi]} for lo, hi, s in shards]

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        return self._params

    async def finish(self, request_id: str) -> bool:
        return True

    def forget(self, request_id: str) -> None:
        pass


def _shard_files(params: dict) -> list[tuple[str, int, int]]:
    """(path, first head, end head) of each file of the destination pool."""
    shards = params.get("shards")
    if shards is None:
        return [(params["path"], 0, int(params["spec"]["num_kv_heads"]))]
    return [(s["path"], int(s["heads"][0]), int(s["heads"][1])) for s in shards]


@register_sender("shm")
class ShmSender:
    name = "shm"

    def __init__(self, **_):
        # keyed by the files' (path, inode) pairs: a restarted decode worker has new files
        self._attached: dict[tuple[tuple[str, int], ...], KVCache | ShardedKVCache] = {}

    def usable(self, params: dict) -> bool:
        if params.get("host") != host_id():
            return False
        try:
            return all(os.path.exists(path) for path, _, _ in _shard_files(params))
        except (KeyError, TypeError, ValueError, IndexError):
            return False

    def _attach(self, params: dict) -> KVCache | ShardedKVCache:
        files = _shard_files(params)
        key = tuple((path, os.stat(path).st_ino) for path, _, _ in files)
        kv = self._attached.get(key)
        if kv is None:
            self._prune(keep=key)
            spec = KVCacheSpec.from_dict(params["spec"])
            bounds = [0, *(hi for _, _, hi in files)]
            if [lo for _, lo, _ in files] != bounds[:-1] or bounds[-1] != spec.num_kv_heads or any(
                    hi <= lo for _, lo, hi in files):
                raise ValueError("the decode worker's KV shards do not tile its heads")
            shards = [KVCache.attach(replace(spec, num_kv_heads=hi - lo), path) for path, lo, hi in files]
            kv = shards[0] if len(shards) == 1 else ShardedKVCache(shards)
            self._attached[key] = kv
        return kv

    def _prune(self, keep: tuple[tuple[str, int], ...]) -> None:
        """Unmap files of decode workers that restarted or left (the mapping pins their memory)."""
        for key in list(self._attached):
            if key != keep and (key[0][0] == keep[0][0] or not all(os.path.exists(p) for p, _ in key)):
                self._attached.pop(key).close()

    async def send(self, job: PrefillJob, params: dict, src: KVCache | ShardedKVCache,
                   src_blocks: list[int]) -> TransferResult:
        dst = self._attach(params)
        if not src.spec.same_layout(dst.spec):
            raise ValueError("the decode worker's KV layout differs from ours")
        t0 = time.perf_counter()
        await asyncio.to_thread(copy_blocks, src, dst, src_blocks, job.dest_block_ids)
        nbytes = len(src_blocks) * dst.spec.block_bytes
        return TransferResult(self.name, nbytes, time.perf_counter() - t0)
