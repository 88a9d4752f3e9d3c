"""Tenants on a real mesh (issue 32): a gateway with API keys of several tenants and a mocker
decode worker, both under one generated block-hash secret, driven by the official ``openai``
client.

No prefix is reused across tenants (``cached_tokens`` 0 for the other tenant's identical prompt,
the whole prefix for the same tenant's); keys of one ``cache_group`` share; a ``cache_salt``
makes its own scope; ``priority`` above a key's ``max_priority`` reaches the worker lowered; the
worker names blocks under the mesh's secret and the request's scope, as a router holding the
same secret predicts (and one holding another secret does not).
"""

from __future__ import annotations

import random
import uuid

import httpx
import openai
import pytest

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, generate_hash_key, hash_seed
from mesh.client import generate
from mesh.natsserver import free_port
from mesh.protocol import GenerateRequest, SamplingOptions
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher, wait_http_ok

WORKER = "tenant-mock"
KEYS = """sk-tenant-a-1 tenant=a
sk-tenant-a-2 tenant=a
sk-tenant-b-1 tenant=b
sk-group-c-1 tenant=c cache_group=shared max_priority=2
sk-group-d-1 tenant=d cache_group=shared
"""


@pytest.fixture(scope="module")
def mesh(cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenancy")
    key = generate_hash_key()
    (d / "hash.key").write_text(key.hex() + "\n")
    (d / "keys.txt").write_text(KEYS)
    secret = ("--hash-key-file", str(d / "hash.key"))
    cluster.worker("mock", "--worker-id", WORKER, "--mock-speedup", "50", *secret)
    port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--host", "127.0.0.1", "--port", str(port),
                  "--api-key-file", str(d / "keys.txt"), *secret)
    base = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{base}/health", 90)
    return base, key


def prompt() -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(3, 30000) for _ in range(64 + 3)]  # 4 full blocks of 16


async def cached(base: str, key: str, tokens: list[int], **extra) -> int:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    r = await client.completions.create(model="mock", prompt=tokens, max_tokens=2, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


async def test_no_prefix_crosses_tenants_but_hits_within_one(mesh):
    base, _ = mesh
    p = prompt()
    assert await cached(base, "sk-tenant-a-1", p) == 0
    assert await cached(base, "sk-tenant-b-1", p) == 0  # b cannot confirm that a sent it
    assert await cached(base, "sk-tenant-a-2", p) == 64  # another key of tenant a: a's cache
    assert await cached(base, "sk-tenant-b-1", p) == 64  # and b's own, now


async def test_a_cache_group_shares_across_its_tenants(mesh):
    base, _ = mesh
    p = prompt()
    assert await cached(base, "sk-group-c-1", p) == 0
    assert await cached(base, "sk-group-d-1", p) == 64
    assert await cached(base, "sk-tenant-a-1", p) == 0  # outside the group


async def test_cache_salt_makes_its_own_scope(mesh):
    base, _ = mesh
    p = prompt()
    assert await cached(base, "sk-tenant-a-1", p, cache_salt="s1") == 0
    assert await cached(base, "sk-tenant-a-1", p, cache_salt="s2") == 0
    assert await cached(base, "sk-tenant-a-1", p) == 0
    assert await cached(base, "sk-tenant-a-2", p, cache_salt="s1") == 64
    for bad in ("", 7, "x" * 257):
        with pytest.raises(openai.BadRequestError) as e:
            await cached(base, "sk-tenant-a-1", p, cache_salt=bad)
        assert e.value.status_code == 400 and "cache_salt" in str(e.value.body)


async def test_priority_is_lowered_to_the_keys_max(mesh, cluster):
    base, _ = mesh
    w = await Watcher.open(cluster.nats_url)
    seen: list[GenerateRequest] = []

    async def on_request(req: GenerateRequest, raw) -> None:
        seen.append(req)

    try:
        await w.bus.subscribe(w.bus.subjects.generate("mock", WORKER), on_request, expect=GenerateRequest)
        await w.bus.flush(5)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-group-c-1", max_retries=0)
        await client.completions.create(model="mock", prompt=[5, 6, 7], max_tokens=1, extra_body={"priority": 1000})
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-tenant-a-1", max_retries=0)
        await client.completions.create(model="mock", prompt=[5, 6, 7], max_tokens=1,
                                        extra_headers={"x-priority": "7"})
        await client.completions.create(model="mock", prompt=[5, 6, 7], max_tokens=1,
                                        extra_headers={"x-priority": "batch"})
        await w.wait_for(lambda: len(seen) >= 3, 10, "the requests on the bus")
    finally:
        await w.close()
    assert [r.priority for r in seen] == [2, 0, -1]
    scopes = {r.cache_scope for r in seen}
    assert len(scopes) == 2 and "" not in scopes and not any("shared" in s or s == "a" for s in scopes)
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        metrics = (await http.get("/metrics")).text
    assert "pdmesh_gateway_priority_clamped_total 2.0" in metrics


async def test_the_worker_hashes_under_the_mesh_secret_and_the_scope(mesh, cluster):
    """A router with the mesh's secret sees the worker's blocks (KV events) under the request's
    scope; with another secret, or another scope, it sees none of them."""
    _, key = mesh
    w = await Watcher.open(cluster.nats_url)
    router = KvRouter(w.bus, w.membership, RouterConfig(mode="kv", hash_key=key))
    await router.start()
    try:
        await w.wait_workers("decode", 1, model="mock")
        p = prompt()
        req = GenerateRequest(uuid.uuid4().hex, "mock", p, SamplingOptions(max_tokens=1), cache_scope="scope-x")
        async for _ in generate(w.bus, WORKER, req):
            pass
        idx = router.index("mock")
        mine = block_hashes(p, 16, hash_seed(key, "mock", "scope-x"))
        await w.wait_for(lambda: idx.overlap(mine).get(WORKER, 0) == 4, 10, "the worker's KV events")
        for other in (hash_seed(DEFAULT_HASH_KEY, "mock", "scope-x"), hash_seed(key, "mock"),
                      hash_seed(generate_hash_key(), "mock", "scope-x")):
            assert idx.overlap(block_hashes(p, 16, other)).get(WORKER, 0) == 0
        decision = router.route("mock", p, "again", cache_scope="scope-x")
        assert decision.worker_id == WORKER and decision.overlap_blocks == 4
        again = GenerateRequest("again", "mock", p, SamplingOptions(max_tokens=1), cache_scope="scope-x")
        async for chunk in generate(w.bus, WORKER, again):
            last = chunk
        assert last.usage.cached_tokens == 64  # what the router predicted, from the worker's own hashes
    finally:
        await w.close()
