"""API keys on a real gateway process, with the official ``openai`` client.

One mocker decode worker, one gateway with keys from a flag, from ``MESH_API_KEYS`` and from a
key file (per-key limits in it), ``/metrics`` behind the keys. Without a valid key every
``/v1/*`` route is a 401 that the client raises as ``AuthenticationError``; ``/health`` and
``/live`` stay open; a key past its requests per minute or its concurrent requests gets a 429
with ``Retry-After`` (``RateLimitError``); SIGHUP rereads the file. A second gateway without
keys shows the body cap following the served context, and that a gateway takes a stream's
token chunks only from the worker it sent the stream to (a forged ``TokenBatch`` is dropped).
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from mesh.natsserver import free_port
from mesh.protocol import GenerateRequest, TokenBatch, TokenChunk, decode
from tests.helpers.cluster import Watcher, wait_http_ok

FLAG_KEY = "sk-flag-0123456789"
ENV_KEY = "sk-env-0123456789"
KEYS = """# name and limits per key
sk-file-rpm name=metered rpm=2
sk-file-one name=single max_concurrent=1
sk-file-free name=free
"""


@pytest.fixture(scope="module")
def mesh(cluster, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(KEYS)
    cluster.worker("mock", "--worker-id", "auth-mock", "--mock-speedup", "20")
    port = free_port()
    gw = cluster.spawn("gateway", "--nats", cluster.nats_url, "--host", "127.0.0.1", "--port", str(port),
                       "--api-key", FLAG_KEY, "--api-key-file", str(keyfile), "--metrics-auth",
                       env={"MESH_API_KEYS": ENV_KEY})
    open_port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--host", "127.0.0.1", "--port", str(open_port))
    base, open_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{open_port}"
    for b in (base, open_base):
        wait_http_ok(f"{b}/health", 90)
    return base, open_base, keyfile, gw


def client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


async def complete(base: str, key: str, **kw):
    return await client(base, key).completions.create(model="mock", prompt=[1, 2, 3], max_tokens=2, **kw)


async def test_wrong_or_missing_key_is_an_authentication_error(mesh):
    base, *_ = mesh
    for key in ("sk-wrong", FLAG_KEY[:-1], FLAG_KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            await complete(base, key)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await client(base, key).models.list()
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await http.post(path, json={"model": "mock", "prompt": [1]})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
            assert "missing API key" in r.json()["error"]["message"]
        assert (await http.get("/v1/models", headers={"Authorization": "Basic " + FLAG_KEY})).status_code == 401
        assert (await http.get("/metrics")).status_code == 401  # --metrics-auth
        assert (await http.get("/health")).status_code == 200 and (await http.get("/live")).status_code == 200


async def test_every_configured_key_is_served(mesh):
    base, *_ = mesh
    for key in (FLAG_KEY, ENV_KEY, "sk-file-free"):
        out = await complete(base, key)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
        assert [m.id for m in (await client(base, key).models.list()).data] == ["mock"]
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        r = await http.get("/metrics", headers={"Authorization": f"Bearer {FLAG_KEY}"})
        assert r.status_code == 200
        assert 'pdmesh_gateway_rejected_total{reason="invalid_key"}' in r.text
        assert 'pdmesh_gateway_requests_total{endpoint="completions",status="401"}' in r.text


async def test_requests_per_minute_limit(mesh):
    base, *_ = mesh
    for _ in range(2):
        await complete(base, "sk-file-rpm")
    with pytest.raises(openai.RateLimitError) as e:
        await complete(base, "sk-file-rpm")
    assert e.value.code == "rate_limit_exceeded" and "2 requests per minute" in e.value.message
    assert 20 <= int(e.value.response.headers["retry-after"]) <= 30  # a token every 30 s
    await complete(base, "sk-file-free")  # other keys are not limited by it


async def test_concurrent_requests_limit(mesh):
    base, *_ = mesh
    c = client(base, "sk-file-one")
    # long enough to outlast a loaded machine's delay before the second request (400 tokens at
    # --mock-speedup 20 were done in well under a second, and a CI run's second request came after)
    stream = await c.completions.create(model="mock", prompt=[1, 2, 3], max_tokens=20000, stream=True,
                                        extra_body={"ignore_eos": True})
    first = await anext(aiter(stream))
    assert first.choices
    with pytest.raises(openai.RateLimitError) as e:
        await complete(base, "sk-file-one")
    assert "1 concurrent requests" in e.value.message and e.value.response.headers["retry-after"] == "1"
    await stream.close()  # the slot comes back when the response is done
    for _ in range(50):
        try:
            await complete(base, "sk-file-one")
            break
        except openai.RateLimitError:
            await asyncio.sleep(0.1)
    else:
        pytest.fail("the key's slot never came back")


async def test_sighup_rereads_the_key_file(mesh):
    base, _, keyfile, gw = mesh
    keyfile.write_text(KEYS.replace("sk-file-free name=free", "sk-file-new name=new"))
    os.kill(gw.pid, signal.SIGHUP)
    for _ in range(50):
        try:
            await complete(base, "sk-file-new")
            break
        except openai.AuthenticationError:
            await asyncio.sleep(0.1)
    else:
        pytest.fail("the new key was never accepted")
    with pytest.raises(openai.AuthenticationError):
        await complete(base, "sk-file-free")
    await complete(base, FLAG_KEY)  # flag and environment keys stay
    assert gw.poll() is None  # SIGHUP did not stop the gateway


async def test_body_cap_follows_the_served_context(mesh, cluster):
    _, open_base, *_ = mesh
    w = await Watcher.open(cluster.nats_url)
    try:
        (card,) = await w.wait_workers("decode", 1)
    finally:
        await w.close()
    cap = (1 << 20) + 16 * card.max_model_len
    async with httpx.AsyncClient(base_url=open_base, timeout=30) as http:
        for headers, body in (({}, b" " * (cap + 1)), ({}, _chunks(cap + 1))):  # declared, then chunked
            r = await http.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["type"] == "invalid_request_error" and str(cap) in r.json()["error"]["message"]
        prompt = list(range(1, 2001))
        r = await http.post("/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text  # under the cap: served as before
        metrics = (await http.get("/metrics")).text
    assert 'pdmesh_gateway_rejected_total{reason="body_too_large"} 2.0' in metrics


async def _chunks(n: int, size: int = 1 << 16):
    while n > 0:
        yield b" " * min(size, n)
        n -= size


async def test_token_chunks_only_from_the_streams_worker(mesh, cluster):
    """Whoever sees a request's ``batch_to`` subject sends a chunk for it, claiming another worker:
    the gateway drops it (without the check the client would get its one token and "stop", or a
    502 for the gap it makes)."""
    _, open_base, *_ = mesh
    w = await Watcher.open(cluster.nats_url)
    forged: list[str] = []

    async def forge(msg) -> None:
        req = decode(msg.data, GenerateRequest)
        chunk = TokenChunk(req.request_id, 0, [7], finish_reason="stop", worker="evil", stream=req.stream)
        await w.bus.publish(req.batch_to, TokenBatch("evil", [chunk]))
        forged.append(req.request_id)

    spy = await w.bus.nc.subscribe(w.bus.subjects.generate("mock", "auth-mock"), cb=forge)
    try:
        await w.bus.nc.flush()
        out = await client(open_base, "none").completions.create(
            model="mock", prompt=[1, 2, 3], max_tokens=50, extra_body={"ignore_eos": True})
        assert len(forged) == 1
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 50
        async with httpx.AsyncClient(base_url=open_base, timeout=10) as http:
            metrics = (await http.get("/metrics")).text
        assert 'pdmesh_refused_messages_total{reason="unbound_chunk",role="gateway"} 1.0' in metrics
    finally:
        await spy.unsubscribe()
        await w.close()
