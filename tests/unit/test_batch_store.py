"""The batch store's leases and keep-once results, on an in-memory KV with JetStream's revision
rules: one holder at a time, takeover only after expiry, one result per line."""

from __future__ import annotations

import pytest

from gateway.auth import ApiKey, KeyLimits, _digest
from gateway.batches.lines import LineResult, decode_result, encode_result
from gateway.batches.store import (
    BATCH_PRIORITY,
    BatchRecord,
    BatchStore,
    FileRecord,
    Lease,
    RunAs,
    claimable,
)
from gateway.tenancy import clamp_priority
from tests.helpers.fake_jetstream import FakeJetStream, FakeKV, FakeObjects


@pytest.fixture
def store() -> BatchStore:
    kv = FakeKV()
    return BatchStore(kv, FakeObjects(), FakeJetStream(kv, "b"), "b")


def batch(owner: RunAs, batch_id: str = "batch_1") -> BatchRecord:
    return BatchRecord(batch_id, owner, "/v1/chat/completions", "file-1", "24h", 100, 100 + 86400)


def test_claimable_only_when_free_expired_or_ours():
    assert claimable(None, "a", 10.0)
    assert claimable(Lease("a", 20.0), "a", 10.0)
    assert not claimable(Lease("b", 20.0), "a", 10.0)
    assert claimable(Lease("b", 10.0), "a", 10.0)


async def test_one_holder_at_a_time_and_takeover_after_expiry(store):
    rev_a = await store.claim("batch_1", "gw-a", now=0.0, lease_s=10.0)
    assert rev_a is not None
    assert await store.claim("batch_1", "gw-b", now=5.0, lease_s=10.0) is None  # held by a
    rev_a2 = await store.renew("batch_1", "gw-a", rev_a, now=8.0, lease_s=10.0)
    assert rev_a2 is not None and rev_a2 > rev_a
    assert await store.renew("batch_1", "gw-a", rev_a, now=8.0, lease_s=10.0) is None  # a stale revision
    assert await store.claim("batch_1", "gw-b", now=17.0, lease_s=10.0) is None  # renewed until 18
    rev_b = await store.claim("batch_1", "gw-b", now=18.5, lease_s=10.0)  # a stopped renewing: b takes over
    assert rev_b is not None
    assert await store.renew("batch_1", "gw-a", rev_a2, now=19.0, lease_s=10.0) is None  # a learns it lost it


async def test_a_claim_that_races_another_write_fails(store):
    kv = store.kv
    original = kv.update

    async def racing_update(key, value, last=None):  # another gateway writes between our read and our write
        await kv.put(key, b'{"holder":"gw-b","until":99.0}')
        return await original(key, value, last=last)

    await store.claim("batch_1", "gw-a", now=0.0, lease_s=1.0)
    kv.update = racing_update
    assert await store.claim("batch_1", "gw-c", now=5.0, lease_s=1.0) is None


async def test_a_line_result_is_kept_once(store):
    first = LineResult("req-1", 200, code="", message="")
    second = LineResult("req-1", 500, code="server_error")
    assert await store.record_line("batch_1", 7, encode_result(first))
    assert not await store.record_line("batch_1", 7, encode_result(second))  # a re-run's result: dropped
    assert await store.record_line("batch_1", 8, encode_result(second))
    done = await store.done_lines("batch_1")
    assert sorted(done) == [7, 8] and decode_result(done[7]).status == 200
    assert await store.done_lines("batch_2") == {}


async def test_records_are_read_only_with_their_owners_token(store):
    one = RunAs.of(ApiKey("one", _digest("k1"), KeyLimits()))
    two = RunAs.of(ApiKey("two", _digest("k2"), KeyLimits()))
    same_tenant = RunAs.of(ApiKey("three", _digest("k3"), KeyLimits(), tenant="acme"))
    assert len({one.owner, two.owner, same_tenant.owner, RunAs.of(None).owner}) == 4
    assert RunAs.of(ApiKey("four", _digest("k4"), KeyLimits(), tenant="acme")).owner == same_tenant.owner
    await store.put_file(FileRecord("file-1", one.owner, "in.jsonl", 3, 1, "batch", 1), b"{}\n")
    await store.create_batch(batch(one))
    assert (await store.get_file(one.owner, "file-1")).bytes == 3
    assert await store.get_file(two.owner, "file-1") is None
    assert await store.get_batch(two.owner, "batch_1") is None
    assert await store.get_batch(one.owner, "../batch_1") is None  # not an id: no key is built of it
    assert await store.get_file(one.owner, "fïle-1") is None
    assert [b.id for b in await store.list_batches(one.owner)] == ["batch_1"]
    assert await store.list_batches(two.owner) == []
    assert await store.active() == {"batch_1": one.owner}


async def test_update_batch_retries_on_a_conflict_and_retire_clears_the_batch(store):
    owner = RunAs("o")
    await store.create_batch(batch(owner))
    kv = store.kv
    original, raced = kv.update, []

    async def once_racing(key, value, last=None):
        if not raced:
            raced.append(key)
            await kv.put(key, kv.data[key].value)  # someone else wrote: our revision is stale
        return await original(key, value, last=last)

    kv.update = once_racing
    rec = await store.update_batch("o", "batch_1", lambda r: (r.moved("cancelling", 5), True)[1])
    assert rec.status == "cancelling" and raced
    await store.claim("batch_1", "gw", 0.0, 1.0)
    await store.record_line("batch_1", 0, b"{}")
    await store.record_line("batch_11", 0, b"{}")
    await store.retire("batch_1")
    assert list(await store.done_lines("batch_11")) == [0]  # another batch's results stay
    assert await store.active() == {} and await store.done_lines("batch_1") == {}
    assert (await store.get_batch("o", "batch_1")).status == "cancelling"  # the record stays


def test_a_batch_line_runs_as_its_owner_at_the_lowest_priority():
    key = ApiKey("alice", _digest("secret"), KeyLimits(), tenant="", cache_group="")
    run_as = RunAs.of(key)
    line_key = run_as.api_key()
    assert line_key.cache_owner == key.cache_owner  # the same prefix-cache scope as the key's own requests
    assert clamp_priority(10, line_key) == BATCH_PRIORITY
    assert "secret" not in repr(run_as) and _digest("secret").hex() not in repr(run_as)
    assert RunAs.of(None).api_key() is None
    assert batch(run_as).public()["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
