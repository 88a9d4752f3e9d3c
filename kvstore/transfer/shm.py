"""``shm``: CPU, same host. The decode worker's KV pool is a file in shared memory;
the prefill worker maps it and copies its blocks straight into the destination
blocks (one strided copy per run of consecutive block ids). Nothing to do on
the receiving side: the bytes are in place when the sender says so.

No message names a path. Every KV file lives in one mesh-owned directory,
``/dev/shm/pdmesh-{uid}`` (mode 0700, owned by this user: nobody else can put a
file or a link there), and the receiving (decode) worker creates its own file
there and advertises only the file's *name*. The sender opens that name inside
the directory (``openat``, no symlink followed), checks it is a regular file of
this user as large as the spec says, and that every destination block is in
range; anything else is ``Refused``: the prefill worker logs, counts and drops
the job, and the decode worker prefills locally.

Several ranks: a decode worker of TP x PP ranks has one file per rank, each with
that rank's part (its stage's layers, its share of the heads); its params list them
(``shards``: name, head range and layer range, in rank order; ``spec`` for the whole
pool). The sender maps them all and copies each overlap of its own parts with theirs
(``copy_blocks``), so a prefill worker of any layout feeds a decode worker of any other,
and the KV moves once, straight into the rank that holds it. (``layers`` is left out
for a pool of one stage, as a TP worker has always sent it; a sender that does not know
``layers`` finds a pipeline's shards do not tile the heads and refuses the job.)

    params  {"name", "host", "spec"}                    one file (one rank)
            + {"shards": [{"name", "heads": [lo, hi],   one file per rank
                           "layers": [lo, hi]}]}        (layers: with PP > 1)
            + {"fence": name, "gen": n}                  the job's write fence (``fence``)

A job that times out: the decode worker revokes its blocks through the fence file
(``kvstore.transfer.fence``); they are reused only once no copy into them can be running
or start, so a slow copy never lands in blocks that belong to another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
import time
from dataclasses import replace
from pathlib import Path

from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache, copy_blocks
from kvstore.private import private_dir
from kvstore.transfer import (
    Refused,
    TransferResult,
    TransferTarget,
    host_id,
    register_receiver,
    register_sender,
    run_to_end,
)
from kvstore.transfer.fence import FenceFile, lease

SHM_ROOT = Path("/dev/shm")
PREFIX = "kv-"
_NAME = re.compile(r"kv-[A-Za-z0-9_.-]{1,200}")


def shm_dir() -> Path:
    """The mesh's directory for KV files: created 0700 on first use; refused if it is not a
    private directory of this user (a link, someone else's, or open to others)."""
    return private_dir(SHM_ROOT / f"pdmesh-{os.getuid()}", "the shm transport's")


def shm_path(worker_id: str) -> str:
    """Where a worker of this process creates its KV file."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:150]
    return str(shm_dir() / f"{PREFIX}{os.getpid()}-{safe}")


def segment_name(path: str) -> str:
    """The name a receiver advertises for its KV file (only files in ``shm_dir()`` are served)."""
    p = Path(path)
    if p.parent != shm_dir() or not _NAME.fullmatch(p.name):
        raise ValueError(f"the shm transport serves KV files in {shm_dir()} only, not {path}")
    return p.name


def card_params(kv) -> dict:
    """What a decode worker's registry card may say about its shm pool: no path."""
    return {"name": segment_name(kv.shm_path), "host": host_id()}


def remove_stale_files() -> int:
    """Delete KV files of processes that no longer exist (a killed decode worker leaves one)."""
    removed = 0
    for f in shm_dir().glob(f"{PREFIX}*"):
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
        parts = kv.parts()
        if any(p.cache.shm_path is None for p in parts):
            raise ValueError("the shm transport needs a KV cache in shared memory")
        self._params = {"name": segment_name(parts[0].cache.shm_path), "host": host_id(), "spec": kv.spec.to_dict()}
        if len(parts) > 1:
            staged = any(p.layers != parts[0].layers for p in parts)
            self._params["shards"] = [{"name": segment_name(p.cache.shm_path), "heads": list(p.heads),
                                       **({"layers": list(p.layers)} if staged else {})} for p in parts]
        self.fence = FenceFile(parts[0].cache.shm_path + ".fence", kv.spec.num_blocks)
        self._params["fence"] = segment_name(self.fence.path)
        self._jobs: dict[str, list[int]] = {}  # request id -> its destination blocks, until forgotten

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        self._jobs[request_id] = list(dest_blocks)
        return {**self._params, "gen": self.fence.arm(dest_blocks)}

    async def finish(self, request_id: str) -> bool:
        return True

    def revoke(self, request_id: str) -> bool:
        """True once no copy into the request's blocks runs or can start (see ``fence``)."""
        blocks = self._jobs.get(request_id)
        return blocks is None or self.fence.revoke(blocks)

    def forget(self, request_id: str) -> None:
        self._jobs.pop(request_id, None)

    def close(self) -> None:
        self.fence.close()


def _name_of(entry: dict) -> str:
    """The file a params entry names, checked: a plain ``kv-*`` name. (A ``path`` from an older
    decode worker is accepted only when it is exactly a file of ``shm_dir()``.)"""
    if "name" in entry:
        name = entry["name"]
    elif "path" in entry:
        path = str(entry["path"])
        if os.path.dirname(path) != str(shm_dir()):
            raise Refused(f"KV file outside {shm_dir()}")
        name = os.path.basename(path)
    else:
        raise Refused("no KV file named")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise Refused("not a KV file name")
    return name


def _shard_files(params: dict) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """(file name, layer range, head range) of each file of the destination pool, in rank order;
    ``Refused`` for anything malformed or outside the mesh's directory."""
    try:
        spec = params["spec"]
        every_layer = (0, int(spec["num_layers"]))
        shards = params.get("shards")
        if shards is None:
            return [(_name_of(params), every_layer, (0, int(spec["num_kv_heads"])))]
        return [(_name_of(s), (int(s["layers"][0]), int(s["layers"][1])) if "layers" in s else every_layer,
                 (int(s["heads"][0]), int(s["heads"][1]))) for s in shards]
    except Refused:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise Refused(f"malformed shm params ({type(e).__name__})") from None


def _tiling_tp(files: list[tuple[str, tuple[int, int], tuple[int, int]]], spec: KVCacheSpec) -> int:
    """The TP degree of a pool whose files tile its layers (stage by stage) and, within each
    stage, its heads (rank by rank); ``Refused`` if they do not."""
    tp = sum(1 for _, layers, _ in files if layers == files[0][1])
    stages = [files[i:i + tp] for i in range(0, len(files), tp)]
    layer = 0
    for stage in stages:
        head = 0
        for _, (l0, l1), (h0, h1) in stage:
            if (l0, l1) != (layer, stage[0][1][1]) or h0 != head or h1 <= h0 or l1 <= l0:
                raise Refused("the decode worker's KV shards do not tile its layers and heads")
            head = h1
        if head != spec.num_kv_heads:
            raise Refused("the decode worker's KV shards do not tile its heads")
        layer = stage[0][1][1]
    if layer != spec.num_layers or len(files) % tp:
        raise Refused("the decode worker's KV shards do not tile its layers")
    return tp


def open_kv_file(name: str, kind: str = "KV", min_size: int = 0) -> tuple[int, os.stat_result]:
    """Open the ``kind`` file ``name`` of the mesh's directory: a plain ``kv-*`` name, opened
    relative to the directory, no symlink followed, a regular file of this user of at least
    ``min_size`` bytes; ``Refused`` otherwise. The caller closes the descriptor."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise Refused(f"not a {kind} file name")
    dir_fd = os.open(shm_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise Refused(f"cannot open {kind} file {name}: {e.strerror}") from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < min_size:
        os.close(fd)
        raise Refused(f"{name} is not a {kind} file of this user")
    return fd, st


def _open_segment(name: str, spec: KVCacheSpec) -> KVCache:
    """Map the KV file ``name`` (``open_kv_file``), at least as large as ``spec``."""
    fd, st = open_kv_file(name)
    try:
        if st.st_size < spec.total_bytes:
            raise Refused(f"{name} is smaller than its spec says")
        return KVCache.attach_fd(spec, fd, str(shm_dir() / name))
    finally:
        os.close(fd)


@register_sender("shm")
class ShmSender:
    """``copy_delay_s``: fault injection (tests, chaos runs): each copy waits this long under its
    write fence before it writes, so that it ends after the job's deadline."""

    name = "shm"

    def __init__(self, copy_delay_s: float = 0.0, **_):
        self.copy_delay_s = copy_delay_s
        # keyed by the files' (name, inode) pairs: a restarted decode worker has new files
        self._attached: dict[tuple[tuple[str, int], ...], KVCache | ShardedKVCache] = {}

    def usable(self, params: dict) -> bool:
        if params.get("host") != host_id():
            return False
        d = shm_dir()
        for name, _, _ in _shard_files(params):
            try:
                st = os.lstat(d / name)
            except FileNotFoundError:
                return False  # not on this host after all (or the decode worker left)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise Refused(f"{name} is not a KV file of this user (a link, or someone else's)")
        return True

    def _attach(self, params: dict) -> KVCache | ShardedKVCache:
        files = _shard_files(params)
        try:
            spec = KVCacheSpec.from_dict(params["spec"])
        except (KeyError, TypeError, ValueError) as e:
            raise Refused(f"malformed KV spec ({e})") from None
        key = tuple((name, os.stat(shm_dir() / name, follow_symlinks=False).st_ino) for name, _, _ in files)
        kv = self._attached.get(key)
        if kv is None:
            self._prune(keep=key)
            tp = _tiling_tp(files, spec)
            shards = [_open_segment(name, replace(spec, num_layers=l1 - l0, num_kv_heads=h1 - h0))
                      for name, (l0, l1), (h0, h1) in files]
            kv = shards[0] if len(shards) == 1 else ShardedKVCache(shards, tp)
            self._attached[key] = kv
        return kv

    def _prune(self, keep: tuple[tuple[str, int], ...]) -> None:
        """Unmap files of decode workers that restarted or left (the mapping pins their memory)."""
        d = shm_dir()
        for key in list(self._attached):
            if key != keep and (key[0][0] == keep[0][0] or not all((d / n).exists() for n, _ in key)):
                self._attached.pop(key).close()

    async def send(self, target: TransferTarget, params: dict, src: KVCache | ShardedKVCache,
                   src_blocks: list[int]) -> TransferResult:
        dst = self._attach(params)
        if not src.spec.same_layout(dst.spec):
            raise ValueError("the decode worker's KV layout differs from ours")
        if any(not 0 <= b < dst.spec.num_blocks for b in target.dest_block_ids):
            raise Refused("destination block out of range")
        fence_fd = _open_fence(params, dst.spec.num_blocks)
        t0 = time.perf_counter()
        # The copy runs to its end even if this task is cancelled (a timeout): whoever hears of
        # this job's end next (PrefillDone) may take it that nothing writes the blocks any more.
        copy = asyncio.get_running_loop().run_in_executor(
            None, _fenced_copy, src, dst, src_blocks, target.dest_block_ids, fence_fd, params.get("gen"),
            self.copy_delay_s)
        await run_to_end(copy)
        nbytes = len(src_blocks) * dst.spec.block_bytes
        return TransferResult(self.name, nbytes, time.perf_counter() - t0)


def _open_fence(params: dict, num_blocks: int) -> int | None:
    """The job's fence file, opened like the KV file (no link followed, a file of this user, large
    enough); None for a decode worker that names none (then nothing fences a late copy)."""
    if "fence" not in params:
        return None
    name = params["fence"]
    if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(params.get("gen"), int):
        raise Refused("malformed fence params")
    return open_kv_file(name, "fence", 4 * num_blocks)[0]


def _fenced_copy(src, dst, src_ids: list[int], dst_ids: list[int], fence_fd: int | None, gen,
                 delay_s: float) -> None:
    """The copy, under the job's write lease when the decode worker gave a fence (in a thread)."""
    try:
        with lease(fence_fd, dst_ids, gen) if fence_fd is not None else contextlib.nullcontext():
            if delay_s:  # fault injection: a copy that ends after the deadline
                time.sleep(delay_s)
            copy_blocks(src, dst, src_ids, dst_ids)
    finally:
        if fence_fd is not None:
            os.close(fence_fd)
