"""The disk tier: one file per KV block under a directory, capped in bytes, coldest evicted first.

Nothing on disk is trusted blindly. A file is

    header (48 bytes): magic "PDKV", version, flags, layout fingerprint, block hash,
                       parent hash, payload length, checksum
    payload:           the block's bytes, block-major (``spec.block_shape``)

and a block is served only if every header field matches what this engine expects
and the checksum is right. The checksum is xxh3-64 of the payload, or, given the mesh
secret (``checksum_key``), a keyed BLAKE2b-64 of the header's fields and the payload
(flag ``KEYED``): whoever can write the directory but lacks the secret cannot make a
block this engine serves, nor move one file to another block's name. The directory is
the owner's alone (0700, files 0600, refused if it is anyone else's or open to
others), as the shm transport's is. A file that fails (flipped bytes,
truncated, another model's, half written by a crash) is a miss: it is removed and
the block is recomputed. Files are written to a temporary name and renamed, so a
reader sees a whole file or none (no fsync: a file a crash leaves torn fails its
checksum).

The directory holds one subdirectory per layout fingerprint (model identity, KV
layout, dtype), so engines of different models can share a root. A new engine on
the same directory (a restarted worker) finds the blocks written before: the
index is rebuilt from the headers at start, oldest file first in the LRU order
(no events for these: routers take a new worker's blocks from its snapshot).
Workers that share a directory see each other's files only after a restart, and
each caps what it indexes itself; a file another worker removed is a plain miss.

``VirtualDiskTier`` is the same bookkeeping without files (the mocker: hit rates,
KV events and eviction order of a disk tier, no bytes). Both tiers can pin blocks
for a peer fetch (``pin``/``unpin``): a pinned block is never the one evicted.

Torch-free: payloads are bytes-like; the caller converts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import stat
import struct
import time
from collections import OrderedDict
from pathlib import Path

import xxhash

from kvstore.events import BlockRemoved, BlockStored, KvEventLog
from kvstore.private import private_dir

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
HEADER = struct.Struct("<4sHHQQQQQ")  # magic, version, flags, fingerprint, hash, parent, length, xxh3
HAS_PARENT = 1
KEYED = 2  # the checksum is keyed BLAKE2b of the header's fields and the payload
SUFFIX = ".kv"
STALE_TMP_SECONDS = 600.0  # a temporary file this old was left by a crashed writer


def layout_fingerprint(model_identity: str, layout: dict) -> int:
    """A 64-bit name for "blocks of this model with this KV layout and dtype"."""
    text = json.dumps({"model": model_identity, "layout": layout}, sort_keys=True)
    return xxhash.xxh3_64_intdigest(text.encode())


def model_identity(model_dir: str | Path, served_name: str = "") -> str:
    """What distinguishes one checkpoint from another without reading all its weights:
    the config, and per weight file its name, size and checksums of its first and last MiB."""
    d = Path(model_dir)
    h = xxhash.xxh3_64()
    h.update(served_name.encode() + b"\0")
    cfg = d / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(d.glob("*.safetensors")) + sorted(d.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


class DiskTier:
    """Block files under ``root/<fingerprint>/``, an LRU index of them, and a byte cap."""

    tier = "disk"
    stores_bytes = True

    def __init__(self, root: str | Path, capacity_bytes: int, fingerprint: int, payload_bytes: int,
                 events: KvEventLog | None = None, checksum_key: bytes | None = None):
        if capacity_bytes <= 0 or payload_bytes <= 0:
            raise ValueError("the disk tier needs a positive capacity and block size")
        if checksum_key is not None and not 1 <= len(checksum_key) <= 64:
            raise ValueError("the disk tier's checksum key is 1 to 64 bytes (BLAKE2b)")
        self.dir = private_dir(Path(root) / f"{fingerprint:016x}", "the disk KV tier's")
        self.checksum_key = checksum_key
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        self.events = events if events is not None else KvEventLog(enabled=False)
        self._files: OrderedDict[int, int | None] = OrderedDict()  # hash -> parent; front = coldest
        self._pins = PinCounts()
        # counters
        self.written = 0
        self.evicted = 0
        self.corrupt = 0
        self.write_errors = 0
        self._scan()

    # -- queries ------------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    @property
    def used_bytes(self) -> int:
        return len(self._files) * self.file_bytes

    def hashes(self) -> list[int]:
        return list(self._files)

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    # -- reads ---------------------------------------------------------------------------
    def get(self, block_hash: int) -> memoryview | None:
        """The verified payload of a block (writable), or None: not here, unreadable or corrupt
        (then forgotten)."""
        if block_hash not in self._files:
            return None
        try:
            raw = self._read(block_hash)
        except OSError:  # removed behind our back (another worker's eviction): a plain miss
            self._forget(block_hash)
            return None
        if raw is None:
            log.warning("disk KV block %016x failed verification: dropped", block_hash)
            self.corrupt += 1
            self._drop(block_hash)
            return None
        self._files.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(self.path(block_hash))  # the LRU order a restarted engine rebuilds from mtimes
        return raw[HEADER.size :]

    def read(self, block_hash: int) -> memoryview | None:
        """The verified payload, or None, with no bookkeeping (no LRU move, nothing forgotten): what a
        peer fetch reads off the engine thread while the block is pinned (its file stays)."""
        try:
            raw = self._read(block_hash)
        except OSError:
            return None
        return None if raw is None else raw[HEADER.size :]

    def _read(self, block_hash: int) -> memoryview | None:
        """The whole verified file (OSError if it cannot be read; None if it fails its check)."""
        buf = bytearray(self.file_bytes + 1)  # one byte more: a longer file shows
        with os.fdopen(os.open(self.path(block_hash), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            n = f.readinto(buf)
        raw = memoryview(buf)[:n]
        return raw if self._valid(raw, block_hash) else None

    def _valid(self, raw: memoryview, block_hash: int) -> bool:
        if raw.nbytes != self.file_bytes:
            return False
        magic, version, flags, fp, h, _parent, length, checksum = HEADER.unpack_from(raw)
        if (magic, version, fp, h, length) != (MAGIC, VERSION, self.fingerprint, block_hash, self.payload_bytes):
            return False
        if bool(flags & KEYED) != (self.checksum_key is not None):
            return False  # written with another kind of checksum: never trusted
        return self._checksum(raw[: HEADER.size - 8], raw[HEADER.size :]) == checksum

    def _checksum(self, fields, payload) -> int:
        """xxh3-64 of the payload; with the key, keyed BLAKE2b-64 of the header's fields and the payload."""
        if self.checksum_key is None:
            return xxhash.xxh3_64_intdigest(payload)
        mac = hashlib.blake2b(fields, digest_size=8, key=self.checksum_key)
        mac.update(payload)
        return int.from_bytes(mac.digest(), "little")

    # -- writes --------------------------------------------------------------------------
    def touch(self, block_hash: int) -> None:
        if block_hash in self._files:
            self._files.move_to_end(block_hash)

    def put(self, block_hash: int, parent: int | None, payload) -> bool:
        """Write a block (``payload``: bytes-like, ``payload_bytes`` long); True if a new file was written."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return False
        data = memoryview(payload).cast("B")
        if data.nbytes != self.payload_bytes:
            raise ValueError(f"a disk block is {self.payload_bytes} bytes, got {data.nbytes}")
        if self.file_bytes > self.capacity_bytes:
            return False
        while self.used_bytes + self.file_bytes > self.capacity_bytes:
            if not self._evict_coldest():
                return False  # every file is pinned by a peer fetch: this block is not kept
        flags = (HAS_PARENT if parent is not None else 0) | (KEYED if self.checksum_key is not None else 0)
        fields = (MAGIC, VERSION, flags, self.fingerprint, block_hash, parent or 0, data.nbytes)
        header = HEADER.pack(*fields, self._checksum(HEADER.pack(*fields, 0)[: HEADER.size - 8], data))
        final = self.path(block_hash)
        tmp = self.dir / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            # 0600, never through a link: the blocks are prompts' KV
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:  # a full or failing disk costs hit rate, never a request
            self.write_errors += 1
            log.warning("could not write disk KV block %016x: %s", block_hash, e)
            tmp.unlink(missing_ok=True)
            return False
        self._files[block_hash] = parent
        self.written += 1
        self.events.append(BlockStored(block_hash, parent, self.tier))
        return True

    def _evict_coldest(self) -> bool:
        h = self._pins.coldest_unpinned(self._files)
        if h is None:
            return False
        self.evicted += 1
        self._drop(h)
        return True

    # -- pins (a peer fetch reads these blocks) -------------------------------------------
    def pin(self, block_hash: int) -> bool:
        """Keep a held block from eviction until ``unpin``; False if not held."""
        return block_hash in self._files and self._pins.add(block_hash)

    def unpin(self, block_hash: int) -> None:
        self._pins.remove(block_hash)

    def _drop(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)
        self._forget(block_hash)

    def _forget(self, block_hash: int) -> None:
        if block_hash in self._files:
            del self._files[block_hash]
            self.events.append(BlockRemoved(block_hash, self.tier))

    # -- start ---------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the files a previous engine left: checked headers, oldest first; then the cap."""
        now = time.time()
        found: list[tuple[float, int, int | None]] = []
        for p in self.dir.iterdir():
            try:
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                    log.warning("ignoring %s in the disk tier: not a private file of this user", p)
                    continue
                if p.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        p.unlink(missing_ok=True)
                    continue
                if not p.name.endswith(SUFFIX):
                    continue
                entry = self._read_header(p, st.st_size)
            except OSError:
                continue
            if entry is None:
                p.unlink(missing_ok=True)  # a truncated or foreign file: never served
                self.corrupt += 1
                continue
            found.append((st.st_mtime, *entry))
        # No events for what was found: a router learns a new worker's blocks from its snapshot.
        for _, h, parent in sorted(found, key=lambda x: x[0]):
            self._files[h] = parent
        while self._files and self.used_bytes > self.capacity_bytes and self._evict_coldest():
            pass

    def _read_header(self, p: Path, size: int) -> tuple[int, int | None] | None:
        if size != self.file_bytes:
            return None
        with open(p, "rb") as f:
            raw = f.read(HEADER.size)
        if len(raw) != HEADER.size:
            return None
        magic, version, flags, fp, h, parent, length, _ = HEADER.unpack(raw)
        if (magic, version, fp, length) != (MAGIC, VERSION, self.fingerprint, self.payload_bytes):
            return None
        if p.name != f"{h:016x}{SUFFIX}":
            return None
        return h, (parent if flags & HAS_PARENT else None)

    def counters(self) -> dict[str, int]:
        return {
            "disk_blocks": len(self._files), "disk_bytes": self.used_bytes,
            "disk_written_blocks": self.written, "disk_evicted_blocks": self.evicted,
            "disk_corrupt_blocks": self.corrupt, "disk_write_errors": self.write_errors,
            "disk_capacity_blocks": self.capacity_bytes // self.file_bytes,
        }


class PinCounts:
    """Block hashes pinned by peer fetches, with a count each (two fetches may pin one block)."""

    def __init__(self) -> None:
        self._n: dict[int, int] = {}

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._n

    def __len__(self) -> int:
        return len(self._n)

    def add(self, block_hash: int) -> bool:
        self._n[block_hash] = self._n.get(block_hash, 0) + 1
        return True

    def remove(self, block_hash: int) -> None:
        n = self._n.get(block_hash, 0)
        if n > 1:
            self._n[block_hash] = n - 1
        else:
            self._n.pop(block_hash, None)

    def coldest_unpinned(self, lru: OrderedDict) -> int | None:
        """The front-most key of ``lru`` that is not pinned (pinned ones are skipped, not moved)."""
        if not self._n:
            return next(iter(lru), None)
        return next((h for h in lru if h not in self._n), None)


EMPTY = memoryview(b"")  # what a virtual tier returns for a block it holds: no bytes


class VirtualDiskTier:
    """A disk tier of ``capacity_blocks`` blocks that stores no bytes (the mocker).

    The same LRU, cap, pins and KV events as ``DiskTier``; ``get`` returns ``EMPTY`` for a
    held block. Nothing survives a restart.
    """

    tier = "disk"
    stores_bytes = False

    def __init__(self, capacity_blocks: int, events: KvEventLog | None = None):
        if capacity_blocks <= 0:
            raise ValueError(f"a disk tier needs at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.events = events if events is not None else KvEventLog(enabled=False)
        self._blocks: OrderedDict[int, int | None] = OrderedDict()  # hash -> parent; front = coldest
        self._pins = PinCounts()
        self.written = 0
        self.evicted = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[int]:
        return list(self._blocks)

    def touch(self, block_hash: int) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)

    def get(self, block_hash: int) -> memoryview | None:
        if block_hash not in self._blocks:
            return None
        self._blocks.move_to_end(block_hash)
        return EMPTY

    def read(self, block_hash: int) -> memoryview | None:
        return EMPTY if block_hash in self._blocks else None

    def put(self, block_hash: int, parent: int | None, payload=None) -> bool:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return False
        if len(self._blocks) >= self.capacity_blocks:
            victim = self._pins.coldest_unpinned(self._blocks)
            if victim is None:
                return False
            del self._blocks[victim]
            self.evicted += 1
            self.events.append(BlockRemoved(victim, self.tier))
        self._blocks[block_hash] = parent
        self.written += 1
        self.events.append(BlockStored(block_hash, parent, self.tier))
        return True

    def pin(self, block_hash: int) -> bool:
        return block_hash in self._blocks and self._pins.add(block_hash)

    def unpin(self, block_hash: int) -> None:
        self._pins.remove(block_hash)

    def counters(self) -> dict[str, int]:
        return {"disk_blocks": len(self._blocks), "disk_capacity_blocks": self.capacity_blocks,
                "disk_written_blocks": self.written, "disk_evicted_blocks": self.evicted}
