"""Bad input, generated: the HTTP API from its OpenAPI schema (schemathesis) and the bus
messages a worker receives (hypothesis). No 500s, no crashed worker, no leaked blocks."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.bus import Bus
from mesh.natsserver import free_port
from mesh.protocol import Cancel, PrefillDone, decode, encode
from tests.helpers.cluster import Watcher, wait_http_ok

NS = "fuzz"
WORKER = "fuzz-dec"


@pytest.fixture(scope="module")
def fuzz_mesh(cluster, tiny_model):
    proc = cluster.worker("decode", "--ns", NS, "--model", str(tiny_model), "--worker-id", WORKER,
                          "--device-kv-blocks", "256")
    cluster.worker("decode", "--task", "embed", "--ns", NS, "--model", str(tiny_model))  # /v1/embeddings
    port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--ns", NS, "--model", str(tiny_model),
                  "--host", "127.0.0.1", "--port", str(port), "--default-max-tokens", "4")
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health")
    wait_serving(url, "models")  # /health answers 200 once either worker is up
    return url, proc


def wait_serving(url: str, kind: str) -> None:
    """``/health`` lists ``tiny`` under ``kind`` (models: a decode worker; embed_models: an embed
    worker, which starts beside the decode worker and is waited for only when its route is next)."""
    deadline = time.monotonic() + 60
    while "tiny" not in httpx.get(f"{url}/health", timeout=5).json().get(kind, []):
        assert time.monotonic() < deadline, f"no worker for tiny in {kind}"
        time.sleep(0.2)


def test_http_api_never_answers_500(fuzz_mesh):
    """Bodies generated from the gateway's own OpenAPI document (valid and invalid ones)."""
    url, _ = fuzz_mesh
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: dict[int, int] = {}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
        if path == "/v1/embeddings":
            wait_serving(url, "embed_models")

        @given(case=schema[path]["POST"].as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            if isinstance(case.body, dict):  # reach the model (404s are tested elsewhere); keep it short
                if "model" in case.body:
                    case.body["model"] = "tiny"
                for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if isinstance(case.body.get(key), int) and case.body[key] > 8:
                        case.body[key] = 8
                if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
                    case.body["n"] = 2
            response = case.call(timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (response.status_code, response.text[:500])
            if response.status_code >= 400:
                body = response.json()
                assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])

        check()
    assert seen.get(200, 0) > 0 and sum(n for code, n in seen.items() if code >= 400) > 0, seen


BATCH_OPERATIONS = [("/v1/files", "POST"), ("/v1/files", "GET"), ("/v1/files/{file_id}", "GET"),
                    ("/v1/files/{file_id}/content", "GET"), ("/v1/files/{file_id}", "DELETE"),
                    ("/v1/batches", "POST"), ("/v1/batches", "GET"), ("/v1/batches/{batch_id}", "GET"),
                    ("/v1/batches/{batch_id}/cancel", "POST")]


def test_files_and_batches_never_answer_500(fuzz_mesh):
    """The Files and Batch APIs from the same document: uploads, ids and cursors of any shape."""
    url, _ = fuzz_mesh
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: dict[int, int] = {}
    for path, method in BATCH_OPERATIONS:

        @given(case=schema[path][method].as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=30)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.path, case.method, response.status_code, response.text[:500])
            if response.status_code >= 400:
                body = response.json()
                assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])

        check()
    assert seen.get(200, 0) > 0 and seen.get(404, 0) > 0 and seen.get(400, 0) > 0, seen


# -- the bus -----------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                      st.text(max_size=20), st.binary(max_size=20))
any_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.text(max_size=10), inner, max_size=5), max_leaves=20)

request_fields = st.fixed_dictionaries({}, optional={
    "request_id": any_value | st.text(min_size=1, max_size=20),
    "model": st.sampled_from(["tiny", "other", ""]) | any_value,
    "token_ids": st.lists(st.integers(-5, 5000), max_size=40) | any_value,
    "sampling": st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(-3, 8) | any_value, "temperature": st.floats(-1, 3) | any_value,
        "top_p": st.floats(-1, 2) | any_value, "top_k": st.integers(-3, 100) | any_value,
        "seed": st.integers(-(2**63), 2**64 - 1) | st.none(), "logprobs": st.integers(-2, 30) | st.none(),
        "stop_token_ids": st.lists(st.integers(-3, 5000), max_size=3) | any_value,
        "repetition_penalty": st.floats(-1, 3) | st.just(float("nan")) | any_value,
    }) | any_value,
    "priority": st.integers(-(2**63), 2**64 - 1) | any_value,
    "output_offset": st.integers(-3, 50) | any_value,
})

payloads = st.one_of(
    st.binary(max_size=200),
    any_value.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    request_fields.map(lambda d: msgpack.packb({"type": "GenerateRequest", **d}, use_bin_type=True)),
    st.builds(lambda rid: encode(Cancel(rid)), st.text(max_size=10)),
    st.builds(lambda rid, ok, tok: encode(PrefillDone(rid, "nobody", ok, tok)),
              st.text(max_size=10), st.booleans(), st.integers(-5, 2**40)),
    st.sampled_from([b"", b"\x00", msgpack.packb({"type": "TokenChunk"}), msgpack.packb({"type": 5})]),
)


class BusFuzzer:
    """A bus client on its own event loop; each example is published to one of the worker's
    subjects, with a reply inbox, and any replies are read back and must decode."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.bus = self.loop.run_until_complete(Bus.connect(url, "fuzzer", ns=NS))
        s = self.bus.subjects
        self.subjects = [s.generate("tiny", WORKER), s.cancel("tiny", WORKER), s.kv_ready("tiny", WORKER),
                         s.kv_snapshot("tiny", WORKER), s.kv_data("tiny", WORKER, "x")]
        self.replies: list[bytes] = []
        self.inbox = self.bus.nc.new_inbox()

        async def on_reply(msg):
            self.replies.append(msg.data)

        self.loop.run_until_complete(self.bus.nc.subscribe(self.inbox + ".*", cb=on_reply))

    def send(self, which: int, payload: bytes) -> None:
        async def go():
            await self.bus.nc.publish(self.subjects[which % len(self.subjects)], payload,
                                      reply=f"{self.inbox}.{uuid.uuid4().hex[:8]}")
            await self.bus.nc.flush(timeout=5)

        self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.bus.close())
        self.loop.close()


@pytest.fixture(scope="module")
def fuzzer(cluster, fuzz_mesh):
    f = BusFuzzer(cluster.nats_url)
    yield f
    f.close()


@given(which=st.integers(0, 4), payload=payloads)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_worker_survives_any_bus_message(fuzzer, which, payload):
    fuzzer.send(which, payload)


async def test_after_the_fuzzing_the_worker_serves_and_holds_no_blocks(cluster, fuzz_mesh, fuzzer):
    url, proc = fuzz_mesh
    assert proc.poll() is None, "the worker died"
    # every reply it sent is a well-formed message
    for raw in fuzzer.replies:
        decode(raw)
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "still there?",
                                                             "max_tokens": 3})
    assert r.status_code == 200, r.text
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        await w.wait_for(lambda: (r := w.loads.get(WORKER)) and r.running == 0 and r.kv_blocks_used == 0
                         and r.waiting == 0, 60, "the worker to be idle with no blocks held")
        assert w.loads[WORKER].counters.get("requests", 0) > 0  # well-formed requests got through too
    finally:
        await w.close()
