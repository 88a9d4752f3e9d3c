"""The stored responses' bucket on a real nats-server: records by tenant, the TTL it is created
with, the size bound, and a bucket the server lost opened anew."""

from __future__ import annotations

import types

import pytest

from gateway.errors import APIError
from gateway.responses.conversations import Conversations
from mesh.bus import Bus

RID = "resp_" + "a" * 32


async def test_records_are_per_tenant_bounded_and_survive_a_lost_bucket(nats_server):
    bus = await Bus.connect(nats_server.url, "conversations-test", ns="convtest")
    try:
        store = Conversations(types.SimpleNamespace(bus=bus), ttl=120.0)
        record = {"response": {"id": RID}, "history": [{"role": "user", "content": "hi"}]}
        await store.put("tenant1", RID, record)
        assert await store.get("tenant1", RID) == record
        assert await store.get("tenant2", RID) is None  # another tenant: no such key
        assert await store.get("tenant1", "resp_../x") is None  # not an id: never a key
        kv = await bus.js.key_value("convtest_responses")
        assert (await kv.status()).ttl == 120.0

        with pytest.raises(APIError) as e:
            await store.put("tenant1", RID, {"history": [{"role": "user", "content": "x" * bus.max_payload}]})
        assert e.value.status == 400 and e.value.param == "store"

        assert not await store.delete("tenant2", RID) and await store.delete("tenant1", RID)
        assert await store.get("tenant1", RID) is None

        await bus.js.delete_key_value("convtest_responses")  # a NATS restart without storage
        await store.put("tenant1", RID, record)
        assert await store.get("tenant1", RID) == record
        await bus.js.delete_key_value("convtest_responses")
        assert await store.get("tenant1", RID) is None  # gone with the bucket: a 404, not a 503
        await store.put("tenant1", RID, record)
        assert await store.get("tenant1", RID) == record
    finally:
        await bus.close()
