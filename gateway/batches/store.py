"""Where /v1/files and /v1/batches keep their state: JetStream's object store and key-value.

    object store {ns}_files    file id -> the file's bytes (inputs, outputs, error files)
    KV {ns}_batches            file.{owner}.{id}   FileRecord
                               batch.{owner}.{id}  BatchRecord (status, counts, output ids)
                               active.{id}         owner token: a batch not finished yet
                               lease.{id}          Lease: which gateway runs it, until when
                               done.{id}.{line}    one line's result, created once (first wins)

Every gateway of the mesh sees the same state, so a batch survives a gateway restart and any
gateway may run it. Two gateways never run one batch at once: the lease is taken and renewed
with compare-and-set (``update(last=rev)``), and taken over only after it expires. A line's result
is written with ``create``: when a line runs twice (its gateway died mid-line, the next one ran
it again), the second result is refused and only the first is kept and written out.

``owner`` is a token of the tenant (or key) that created a record; a record is read only with
its owner's token, so another tenant's ids are 404 (``BatchStore.get_*`` return None).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import Callable

import msgspec
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from gateway.auth import ApiKey, KeyLimits
from mesh.bus import Bus
from mesh.registry import js_replicas

TIMEOUT = 10.0  # seconds for one KV or object-store operation
BATCH_PRIORITY = -(1 << 31)  # the lowest a request may have: batch lines yield to everything

# statuses: not finished (a runner works on it) and final
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")


class RunAs(msgspec.Struct, frozen=True):
    """Who a batch's lines run as: the creating key's tenancy, never its secret. ``owner`` is the
    token records are filed under; ``cache_owner`` keeps the key's prefix-cache scope."""

    owner: str
    name: str = ""
    tenant: str = ""
    cache_group: str = ""
    key_hash: str = ""  # sha256 of the key's digest (hex): what ApiKey.cache_owner derives from

    @classmethod
    def of(cls, key: ApiKey | None) -> RunAs:
        if key is None:  # API keys off: one tenant
            return cls(owner="anonymous")
        who = f"tenant:{key.tenant}" if key.tenant else f"key:{key.digest.hex()}"
        owner = hashlib.sha256(who.encode()).hexdigest()[:32]
        return cls(owner, key.name, key.tenant, key.cache_group, hashlib.sha256(key.digest).hexdigest())

    def api_key(self) -> ApiKey | None:
        """The ``scope["state"]["api_key"]`` a line runs with: the key's tenancy, at the lowest
        priority (``clamp_priority`` lowers whatever a line asks for to it)."""
        if self.owner == "anonymous":
            return None
        return _RunKey(f"batch:{self.name}", bytes.fromhex(self.key_hash), KeyLimits(), "user", self.tenant,
                       self.cache_group, BATCH_PRIORITY)


class _RunKey(ApiKey):
    """An ApiKey whose ``digest`` is already the hash ``cache_owner`` takes of a real key's."""

    @property
    def cache_owner(self) -> str:
        if self.cache_group:
            return f"group:{self.cache_group}"
        return f"tenant:{self.tenant}" if self.tenant else f"key:{self.digest.hex()[:32]}"


class FileRecord(msgspec.Struct):
    id: str
    owner: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    lines: int = 0  # requests in it (a batch input), counted against the queued-requests limit

    def public(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


class BatchRecord(msgspec.Struct):
    id: str
    run_as: RunAs
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None
    usage: dict | None = None  # the lines' tokens, summed when the batch finished (the Batch object's shape)
    at: dict[str, int] = msgspec.field(default_factory=dict)  # status -> when it was entered

    @property
    def owner(self) -> str:
        return self.run_as.owner

    def moved(self, status: str, now: int) -> None:
        self.status = status
        self.at.setdefault(status, now)

    def public(self) -> dict:
        at = self.at
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": (
                {"object": "list", "data": self.errors} if self.errors else None),
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": at.get("in_progress"), "expires_at": self.expires_at,
            "finalizing_at": at.get("finalizing"), "completed_at": at.get("completed"),
            "failed_at": at.get("failed"), "expired_at": at.get("expired"), "cancelling_at": at.get("cancelling"),
            "cancelled_at": at.get("cancelled"), "metadata": self.metadata,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": self.usage,
        }


class Lease(msgspec.Struct, frozen=True):
    holder: str  # the gateway process running the batch
    until: float  # wall-clock seconds: after it, any gateway may take the batch over


def claimable(lease: Lease | None, me: str, now: float) -> bool:
    """May ``me`` take (or keep) a batch whose lease is ``lease``?"""
    return lease is None or lease.holder == me or lease.until <= now


_ENC = msgspec.json.Encoder()


async def _timed(aw, timeout: float = TIMEOUT):
    return await asyncio.wait_for(aw, timeout)


class BatchStore:
    """The two JetStream buckets; every operation bounded by ``TIMEOUT``."""

    def __init__(self, kv: KeyValue, files: ObjectStore, js, bucket: str):
        self.kv = kv
        self.files = files
        self.js = js  # JetStream: purges a batch's line results in one request
        self.bucket = bucket

    @classmethod
    async def open(cls, bus: Bus) -> BatchStore:
        kv_name, obj_name = bus.subjects.batches_bucket(), bus.subjects.files_bucket()
        replicas = js_replicas(bus)
        try:
            kv = await _timed(bus.js.key_value(kv_name))
        except BucketNotFoundError:
            with contextlib.suppress(Exception):  # a race with another gateway: open theirs below
                await _timed(bus.js.create_key_value(KeyValueConfig(bucket=kv_name, history=1, replicas=replicas)))
            kv = await _timed(bus.js.key_value(kv_name))
        try:
            files = await _timed(bus.js.object_store(obj_name))
        except (BucketNotFoundError, NotFoundError):
            with contextlib.suppress(Exception):
                await _timed(bus.js.create_object_store(obj_name, ObjectStoreConfig(bucket=obj_name,
                                                                                    replicas=replicas)))
            files = await _timed(bus.js.object_store(obj_name))
        return cls(kv, files, bus.js, kv_name)

    # -- plain keys --------------------------------------------------------------------
    async def _get(self, key: str, kind: type):
        """(value, revision), or (None, None) when the key is absent."""
        try:
            entry = await _timed(self.kv.get(key))
        except KeyNotFoundError:
            return None, None
        if entry.value is None:
            return None, None
        return msgspec.json.decode(entry.value, type=kind), entry.revision

    async def _scan(self, pattern: str, meta_only: bool = False) -> list:
        """The live entries whose keys match ``pattern`` (a KV subject filter)."""
        watcher = await _timed(self.kv.watch(pattern, ignore_deletes=True, meta_only=meta_only))
        out = []
        try:
            while True:
                entry = await watcher.updates(TIMEOUT)
                if entry is None:
                    return out
                if entry.value is not None or meta_only:
                    out.append(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    # -- files --------------------------------------------------------------------------
    async def put_file(self, rec: FileRecord, data: bytes) -> None:
        await _timed(self.files.put(rec.id, data), TIMEOUT + len(data) / 20e6)
        await _timed(self.kv.put(f"file.{rec.owner}.{rec.id}", _ENC.encode(rec)))

    async def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        if not _is_id(file_id):
            return None
        return (await self._get(f"file.{owner}.{file_id}", FileRecord))[0]

    async def file_data(self, rec: FileRecord) -> bytes:
        result = await _timed(self.files.get(rec.id), TIMEOUT + rec.bytes / 20e6)
        return result.data or b""

    async def list_files(self, owner: str) -> list[FileRecord]:
        entries = await self._scan(f"file.{owner}.*")
        return [msgspec.json.decode(e.value, type=FileRecord) for e in entries]

    async def delete_file(self, rec: FileRecord) -> None:
        with contextlib.suppress(ObjectNotFoundError, NotFoundError):
            await _timed(self.files.delete(rec.id))
        await _timed(self.kv.purge(f"file.{rec.owner}.{rec.id}"))

    # -- batches ------------------------------------------------------------------------
    async def create_batch(self, rec: BatchRecord) -> None:
        await _timed(self.kv.create(f"batch.{rec.owner}.{rec.id}", _ENC.encode(rec)))
        await _timed(self.kv.put(f"active.{rec.id}", rec.owner.encode()))

    async def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        if not _is_id(batch_id):
            return None
        return (await self._get(f"batch.{owner}.{batch_id}", BatchRecord))[0]

    async def list_batches(self, owner: str) -> list[BatchRecord]:
        entries = await self._scan(f"batch.{owner}.*")
        return [msgspec.json.decode(e.value, type=BatchRecord) for e in entries]

    async def update_batch(self, owner: str, batch_id: str,
                           change: Callable[[BatchRecord], bool]) -> BatchRecord | None:
        """Read, ``change`` in place (it returns whether to write), write with compare-and-set;
        again on a conflict. The record as it stands after, or None when it does not exist."""
        if not _is_id(batch_id):
            return None
        key = f"batch.{owner}.{batch_id}"
        for _ in range(20):
            rec, rev = await self._get(key, BatchRecord)
            if rec is None or not change(rec):
                return rec
            try:
                await _timed(self.kv.update(key, _ENC.encode(rec), last=rev))
                return rec
            except KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"batch {batch_id}: too many concurrent updates")

    async def active(self) -> dict[str, str]:
        """Batches not finished: batch id -> owner token."""
        return {e.key.removeprefix("active."): e.value.decode() for e in await self._scan("active.*")}

    async def retire(self, batch_id: str) -> None:
        """A finished batch: no longer active, no lease, its line results gone (they are in its files)."""
        await _timed(self.kv.purge(f"active.{batch_id}"))
        with contextlib.suppress(Exception):
            await _timed(self.kv.purge(f"lease.{batch_id}"))
        # every line's key at once: a KV bucket is the stream KV_{bucket}, a key the subject $KV.{bucket}.{key}
        await _timed(self.js.purge_stream(f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.done.{batch_id}.*"))

    # -- leases -------------------------------------------------------------------------
    async def claim(self, batch_id: str, me: str, now: float, lease_s: float) -> int | None:
        """Take or renew the batch's lease: its new revision, or None when another gateway holds it."""
        key = f"lease.{batch_id}"
        lease, rev = await self._get(key, Lease)
        if not claimable(lease, me, now):
            return None
        value = _ENC.encode(Lease(me, now + lease_s))
        try:
            if rev is None:
                return await _timed(self.kv.create(key, value))
            return await _timed(self.kv.update(key, value, last=rev))
        except KeyWrongLastSequenceError:  # another gateway got there between our read and write
            return None

    async def renew(self, batch_id: str, me: str, rev: int, now: float, lease_s: float) -> int | None:
        """Extend the lease we hold at ``rev``: the new revision, or None when it is no longer ours."""
        try:
            return await _timed(self.kv.update(f"lease.{batch_id}", _ENC.encode(Lease(me, now + lease_s)), last=rev))
        except KeyWrongLastSequenceError:
            return None

    # -- line results -------------------------------------------------------------------
    async def record_line(self, batch_id: str, line: int, result: bytes) -> bool:
        """Keep line ``line``'s result unless one is kept already (then False: this one is dropped)."""
        try:
            await _timed(self.kv.create(f"done.{batch_id}.{line}", result))
            return True
        except KeyWrongLastSequenceError:
            return False

    async def done_lines(self, batch_id: str) -> dict[int, bytes]:
        prefix = f"done.{batch_id}."
        return {int(e.key.removeprefix(prefix)): e.value for e in await self._scan(f"{prefix}*")}


_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _is_id(value: str) -> bool:
    """A file or batch id as we make them (anything else names no record: 404, never a bad key)."""
    return _ID.fullmatch(value) is not None
