"""Traces across gateway, decode and prefill processes, and Prometheus metrics, from real processes.

Each process writes its finished spans as JSON lines (OTEL_TRACES_EXPORTER=file); one request
must be one trace whose spans link up across the three processes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.natsserver import free_port
from tests.helpers.cluster import Watcher, wait_http_ok

NS = "obs"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(cluster, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")

    def env(role):
        return {"OTEL_TRACES_EXPORTER": "file", "MESH_TRACE_FILE": str(d / f"{role}.jsonl")}

    flags = ["--ns", NS, "--model", str(tiny_model), "--device-kv-blocks", "1024"]
    cluster.worker("decode", *flags, "--worker-id", "obs-dec", "--disagg-threshold", "32", env=env("decode"))
    cluster.worker("prefill", *flags, "--worker-id", "obs-pre", env=env("prefill"))
    port = free_port()
    cluster.spawn("gateway", "--nats", cluster.nats_url, "--ns", NS, "--model", str(tiny_model),
                  "--host", "127.0.0.1", "--port", str(port), env=env("gateway"))
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health")
    return url, d


def spans_in(path: Path, trace_hex: str) -> dict[str, dict]:
    if not path.exists():
        return {}
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {s["name"]: s for s in spans if s["context"]["trace_id"] == "0x" + trace_hex}


def sid(span: dict) -> str:
    return span["context"]["span_id"]


async def test_one_request_is_one_trace_across_three_processes(cluster, traced):
    url, d = traced
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        await w.wait_workers("prefill", 1)
        await w.fresh_load("obs-pre")
        await w.fresh_load("obs-dec")
    finally:
        await w.close()
    rng = random.Random(1)
    prompt = [rng.randrange(3, 4000) for _ in range(200)]  # long enough for the prefill worker
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/v1/completions",
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
                              headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gw, dec, pre = (spans_in(d / f"{role}.jsonl", TRACE_ID) for role in ("gateway", "decode", "prefill"))
        if "POST /v1/completions" in gw and "decode.request" in dec and "prefill.job" in pre:
            break
        await asyncio.sleep(0.2)
    server = gw["POST /v1/completions"]
    assert server["parent_id"] == "0x" + PARENT_ID  # continued from the caller's traceparent
    assert server["attributes"]["pdmesh.request_id"] == rid
    assert server["resource"]["attributes"]["service.name"] == "pdmesh-gateway"
    assert "tokenize" not in gw  # token ids need no tokenizing, and no span for it
    generate = gw["generate"]
    assert generate["parent_id"] == sid(server)
    assert gw["route"]["parent_id"] == sid(generate)
    assert gw["route"]["attributes"]["pdworker.base"] == "obs-dec"
    # the decode worker continues the gateway's generate span
    request = dec["decode.request"]
    assert request["parent_id"] == sid(generate)
    assert request["resource"]["attributes"]["service.name"] == "pdmesh-decode"
    assert request["attributes"]["pdmesh.output_tokens"] == 4
    remote = dec["prefill.remote"]
    assert remote["parent_id"] == sid(request)
    assert remote["attributes"]["pdmesh.transport"] == "shm"
    assert dec["decode"]["parent_id"] == sid(request)
    # and the prefill worker continues the decode worker's remote-prefill span
    job = pre["prefill.job"]
    assert job["parent_id"] == sid(remote)
    assert job["resource"]["attributes"]["service.name"] == "pdmesh-prefill"
    for child in ("prefill.queue", "prefill.compute", "kv.transfer"):
        assert pre[child]["parent_id"] == sid(job), child
    assert pre["kv.transfer"]["attributes"]["pdmesh.bytes"] > 0


def metrics_of(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_known_traffic(cluster, traced):
    url, _ = traced
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        dec = w.membership.get("obs-dec") or (await w.wait_workers("decode", 1))[0]
        pre = await w.wait_for(lambda: w.membership.get("obs-pre"), what="the prefill card")
        assert dec.metrics_port > 0 and pre.metrics_port > 0
        async with httpx.AsyncClient(timeout=60) as client:
            before_gw = metrics_of((await client.get(f"{url}/metrics")).text)
            before_dec = metrics_of((await client.get(f"http://127.0.0.1:{dec.metrics_port}/metrics")).text)
            n, out_tokens = 5, 3
            rng = random.Random(2)
            for i in range(n):
                prompt = [rng.randrange(3, 4000) for _ in range(20 if i % 2 else 100)]
                r = await client.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": out_tokens, "temperature": 0})
                assert r.status_code == 200
            assert (await client.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404
            await w.fresh_load("obs-dec")
            gw = metrics_of((await client.get(f"{url}/metrics")).text)
            dm = metrics_of((await client.get(f"http://127.0.0.1:{dec.metrics_port}/metrics")).text)
            pm = metrics_of((await client.get(f"http://127.0.0.1:{pre.metrics_port}/metrics")).text)
    finally:
        await w.close()

    def delta(after, before, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(gw, before_gw, "pdmesh_gateway_requests_total", endpoint="completions", status="200") == n
    assert delta(gw, before_gw, "pdmesh_gateway_requests_total", endpoint="completions", status="404") == 1
    assert delta(gw, before_gw, "pdmesh_gateway_ttft_seconds_count", model="tiny") == n
    assert delta(gw, before_gw, "pdmesh_router_decisions_total", model="tiny", mode="kv") == n
    assert delta(dm, before_dec, "pdmesh_worker_requests_total", model="tiny", role="decode", outcome="finished") == n
    assert delta(dm, before_dec, "pdmesh_worker_ttft_seconds_count", model="tiny") == n
    assert delta(dm, before_dec, "pdmesh_worker_e2e_seconds_count", model="tiny") == n
    assert delta(dm, before_dec, "pdmesh_worker_output_tokens_total", model="tiny") == n * out_tokens
    assert delta(dm, before_dec, "pdmesh_worker_prefill_total", model="tiny", where="remote") >= 2
    assert value(dm, "pdmesh_kv_blocks", model="tiny", role="decode", tier="device", state="used") == 0
    assert value(dm, "pdmesh_kv_blocks", model="tiny", role="decode", tier="device", state="free") == 1024
    assert value(pm, "pdmesh_kv_transfer_bytes_total", model="tiny", transport="shm") > 0
    assert value(pm, "pdmesh_kv_transfer_seconds_count", model="tiny", transport="shm") >= 2


def test_mesh_top_shows_the_workers(cluster, traced):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cli", "top", "--nats", cluster.nats_url, "--ns", NS, "--once"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "model tiny" in r.stdout
    assert "obs-dec" in r.stdout and "obs-pre" in r.stdout
    assert "decode" in r.stdout and "prefill" in r.stdout
