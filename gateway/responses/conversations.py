"""Stored responses and their conversations: the JetStream KV bucket ``{ns}_responses``.

Every gateway of the mesh reads and writes the one bucket, so a response made through one gateway
is retrieved, continued (``previous_response_id``) or deleted through any other. The bucket's
max age is the TTL (``--responses-ttl``; whoever creates the bucket sets it, an existing one
keeps its own), so nobody sweeps: an old response ages out.

A record is one JSON value: the Response object as the client got it, and the conversation's
history up to and including it as chat messages (``gateway.responses.items``), so continuing a
conversation is one read however long it is, and no ancestor's expiry breaks it.

Keys are ``{tenant}.{response id}``. The tenant part is a keyed digest of the API key's tenant
(``tenant_of``): another tenant's id names a key that does not exist (a 404, as a missing one),
and the bucket's keys show no tenant's name. Who deletes what: ``DELETE /v1/responses/{id}``
purges a record, the TTL the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re

from nats.errors import NoRespondersError
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from gateway.auth import ApiKey
from gateway.errors import APIError
from mesh.bus import Bus
from mesh.registry import js_replicas

log = logging.getLogger(__name__)

KV_TIMEOUT = 5.0  # seconds per bucket operation
BIG = 64 << 10  # bytes of JSON worth a thread to encode or decode
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
# what a bucket the server no longer has answers: no stream for a put, none found for a get
LOST = (BucketNotFoundError, NotFoundError, NoStreamResponseError, NoRespondersError)


def tenant_of(key: ApiKey | None, secret: bytes) -> str:
    """The key token of a request's tenant: the API key's tenant, else the key itself (keys off:
    one tenant). Keyed by the mesh secret, so the bucket's keys name nobody."""
    owner = "" if key is None else (f"tenant:{key.tenant}" if key.tenant else f"key:{key.digest.hex()}")
    return hashlib.blake2b(owner.encode(), key=secret, person=b"pdmesh-resp", digest_size=12).hexdigest()


class Conversations:
    """The bucket, opened on first use (the gateway's bus is up by then) and opened anew when the
    server lost it (a NATS restart without storage)."""

    def __init__(self, gateway, ttl: float):
        self.gateway = gateway
        self.ttl = ttl
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    @property
    def bus(self) -> Bus:
        return self.gateway.bus

    async def _bucket(self) -> KeyValue:
        async with self._lock:
            if self._kv is None:
                name = self.bus.subjects.responses_bucket()
                try:
                    self._kv = await self.bus.js.key_value(name)
                except BucketNotFoundError:
                    try:
                        self._kv = await self.bus.js.create_key_value(bucket=name, ttl=self.ttl, history=1,
                                                                      replicas=js_replicas(self.bus))
                    except Exception:  # another gateway created it between our two calls
                        self._kv = await self.bus.js.key_value(name)
            return self._kv

    async def _call(self, op: str, fn):
        """``fn(bucket)`` with a timeout; a lost bucket is opened anew once. A failure is a 503."""
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(KV_TIMEOUT):
                    return await fn(await self._bucket())
            except (KeyNotFoundError, KeyDeletedError):
                raise
            except LOST as e:  # the server lost the bucket: open it anew, once
                self._kv = None
                if attempt:
                    log.warning("responses store: %s failed: %r", op, e)
            except Exception as e:
                log.warning("responses store: %s failed: %r", op, e)
                break
        raise APIError(503, f"the response store is unavailable ({op}); retry shortly")

    def check_room(self, size: int) -> None:
        """A 400 when a record of ``size`` bytes cannot be stored (before generating it, where the
        conversation alone is already too large)."""
        limit = self.bus.max_payload - 1024  # the message's headers and subject
        if size > limit:
            raise APIError(400, f"this conversation is too large to store ({size} bytes; the mesh stores "
                                f"at most {limit}): send store=false and the whole conversation as input",
                           "store", "conversation_too_large")

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        chars = sum(len(m.get("content") or "") for m in record["history"])
        value = await asyncio.to_thread(_encode, record) if chars > BIG else _encode(record)
        self.check_room(len(value))
        await self._call("put", lambda kv: kv.put(f"{tenant}.{response_id}", value))

    async def get(self, tenant: str, response_id: str) -> dict | None:
        """The record, or None: no such response for this tenant (expired, deleted, never stored)."""
        if not RESPONSE_ID.match(response_id):
            return None
        try:
            entry = await self._call("get", lambda kv: kv.get(f"{tenant}.{response_id}"))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        # a long conversation's record is up to a megabyte of JSON: decode it off the event loop
        return await asyncio.to_thread(json.loads, entry.value) if len(entry.value) > BIG else json.loads(entry.value)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Purge the record; False when there was none for this tenant."""
        if await self.get(tenant, response_id) is None:
            return False
        await self._call("delete", lambda kv: kv.purge(f"{tenant}.{response_id}"))
        return True


def _encode(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"no response with id {response_id!r} (it was not stored, was deleted or expired)",
                    param, "not_found")
