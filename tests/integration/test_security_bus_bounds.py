"""Bus messages past their bounds, sent to a real worker process over a real nats-server.

A mocker decode worker gets a ``Cancel`` over its type's size bound, a ``GenerateRequest``
with an unknown field nested 100,000 levels deep and one whose transport-shaped map nests
where the schema allows none. Each is dropped before a handler sees it, logged and counted
in ``pdmesh_bus_dropped_messages_total`` (read from the worker's own /metrics), and the
worker serves the next request as before.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.client import generate
from mesh.protocol import Cancel, GenerateRequest, SamplingOptions, encode
from mesh.subjects import DEFAULT_MAX_BYTES
from tests.helpers.cluster import Watcher

NS = "bounds"
WORKER = "bounds-mock"


@pytest.fixture(scope="module")
def worker(cluster):
    cluster.worker("mock", "--ns", NS, "--worker-id", WORKER, "--mock-speedup", "20")


def dropped(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdmesh_bus_dropped_messages_total":
                out[(s.labels["message"], s.labels["reason"])] = s.value
    return out


def with_unknown_field(msg, name: str, raw_value: bytes) -> bytes:
    """``msg`` encoded with one more key whose value is ``raw_value`` (msgpack bytes, as they are)."""
    data = encode(msg)
    assert data[0] & 0xF0 == 0x80  # a fixmap: one more entry fits its header
    return bytes([data[0] + 1]) + data[1:] + msgspec.msgpack.encode(name) + raw_value


async def test_oversized_and_deeply_nested_messages_are_dropped_unread(cluster, worker):
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        (card,) = await w.wait_workers("decode", 1, timeout=60)
        model, metrics = card.model, f"http://127.0.0.1:{card.metrics_port}/metrics"
        s = w.bus.subjects
        async with httpx.AsyncClient(timeout=10) as http:
            before = dropped((await http.get(metrics)).text)
            oversized = encode(Cancel("r", reply="x" * DEFAULT_MAX_BYTES))
            await w.bus.nc.publish(s.cancel(model, WORKER), oversized)
            deep = with_unknown_field(GenerateRequest("deep", model, [1, 2]), "x", b"\x91" * 100_000 + b"\x01")
            await w.bus.nc.publish(s.generate(model, WORKER), deep, reply="_INBOX.nobody")
            nested = msgspec.msgpack.encode({"type": "GenerateRequest", "request_id": "nested", "model": model,
                                             "token_ids": [[[[1]]]]})
            await w.bus.nc.publish(s.generate(model, WORKER), nested, reply="_INBOX.nobody")
            await w.bus.flush(5)

            async def counted():
                now = dropped((await http.get(metrics)).text)
                return {k: now.get(k, 0) - before.get(k, 0) for k in now}

            want = {("Cancel", "oversized"): 1, ("GenerateRequest", "too_deep"): 1,
                    ("GenerateRequest", "undecodable"): 1}
            for _ in range(50):
                delta = await counted()
                if all(delta.get(k, 0) >= v for k, v in want.items()):
                    break
            assert {k: delta.get(k, 0) for k in want} == want, delta
        # unharmed: the next request is served
        req = GenerateRequest("after", model, [5, 6, 7], SamplingOptions(max_tokens=3, ignore_eos=True))
        chunks = [c async for c in generate(w.bus, WORKER, req, first_timeout=30, idle_timeout=30)]
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 3
    finally:
        await w.close()
