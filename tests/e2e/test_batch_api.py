"""The Files and Batch APIs through the official ``openai`` client against one ``mesh up``.

The mesh runs mocker workers under the tiny model's name (``--mock --model``): the gateway renders
chat with the model's template and tokenizer as for a model worker, and a batch of hundreds of
lines runs in seconds on two cores. Two API keys: two tenants.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import nats
import openai
import pytest

from tests.helpers.cluster import start_up
from tests.helpers.procs import descendants

KEYS = ("batch-key-one", "batch-key-two")
LEASE_S = 2.0

# the endpoint mix of a batch: url -> the body of its line number i, generating at most n tokens
# (/v1/embeddings needs embed workers, which run the model: tests/e2e/test_up_embeddings.py mixes all four)
LINE_BODIES = {
    "/v1/chat/completions": lambda model, i, n: {"model": model, "max_tokens": n,
                                                 "messages": [{"role": "user", "content": f"hello number {i}"}]},
    "/v1/completions": lambda model, i, n: {"model": model, "prompt": f"count to {i}", "max_tokens": n},
    "/v1/responses": lambda model, i, n: {"model": model, "input": f"respond to {i}", "max_output_tokens": n},
}
OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
           "/v1/responses": "response"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model):
    model = tmp_path_factory.mktemp("batch") / "batchy"
    model.symlink_to(tiny_model, target_is_directory=True)
    proc, url = start_up("--mock", "--model", str(model), "--decode", "1", "--prefill", "0", "--no-planner",
                         "--mock-speedup", "20", "--batch-lease", str(LEASE_S),
                         env={"MESH_API_KEYS": ",".join(KEYS)})
    try:
        yield proc, url, "batchy"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=30, max_retries=0)


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def mixed_lines(model: str, n: int, max_tokens: int = 2) -> list[dict]:
    urls = list(LINE_BODIES)
    rows = []
    for i in range(n):
        url = urls[i % len(urls)]
        body = LINE_BODIES[url](model, i, max_tokens)
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return rows


def submit(c: openai.OpenAI, rows: list) -> str:
    f = c.files.create(file=("input.jsonl", jsonl(rows)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(jsonl(rows))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"suite": "e2e"})
    assert b.status == "validating" and b.metadata == {"suite": "e2e"}
    return b.id


def wait_done(c: openai.OpenAI, batch_id: str, timeout: float = 60.0, tolerate_errors: bool = False):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            b = c.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):
            if not tolerate_errors:
                raise
            time.sleep(0.3)
            continue
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not done in {timeout} s: {b}")


def rows_of(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).read().splitlines()]


def test_a_mixed_batch_completes_with_every_custom_id_once(mesh):
    proc, url, model = mesh
    c = client(url)
    rows = mixed_lines(model, 200)
    b = wait_done(c, submit(c, rows))
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (200, 200, 0)
    assert b.error_file_id is None and b.in_progress_at and b.completed_at
    out = rows_of(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(r["custom_id"] for r in rows)
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        route = rows[int(r["custom_id"].split("-")[1])]["url"]
        assert body["object"] == OBJECTS[route]
        generated = body["usage"]["output_tokens" if route == "/v1/responses" else "completion_tokens"]
        assert generated == 2
    prompts = sum(r["response"]["body"]["usage"].get("prompt_tokens", r["response"]["body"]["usage"].get("input_tokens"))
                  for r in out)
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (prompts, 400, prompts + 400)
    assert b.id in [x.id for x in c.batches.list(limit=100).data]
    # another tenant sees none of it
    other = client(url, KEYS[1])
    for call in (lambda: other.batches.retrieve(b.id), lambda: other.files.retrieve(b.output_file_id),
                 lambda: other.files.content(b.input_file_id), lambda: other.batches.cancel(b.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.id not in [x.id for x in other.batches.list().data]
    # finished: of its keys in the batches bucket only its record is left (no lease, no line results)
    deadline = time.monotonic() + 10
    while len(keys := asyncio.run(batch_keys(proc.up_line, b.id))) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [k.split(".")[0] for k in keys] == ["batch"]


async def batch_keys(up_line: str, batch_id: str) -> list[str]:
    """The keys of the batches bucket that name ``batch_id``, read straight from NATS."""
    nc = await nats.connect(re.search(r"NATS (nats://[^)\s]+)", up_line).group(1), connect_timeout=5)
    try:
        watcher = await (await nc.jetstream().key_value("mesh_batches")).watchall(meta_only=True)
        keys = []
        while (entry := await watcher.updates(5)) is not None:
            if batch_id in entry.key and entry.operation is None:
                keys.append(entry.key)
        await watcher.stop()
        return keys
    finally:
        await nc.close()


def test_bad_lines_land_in_the_error_file(mesh):
    _, url, model = mesh
    c = client(url)
    good = {"custom_id": "good", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "hi", "max_tokens": 2}}
    rows = [
        good,
        b"{not json",
        {"method": "POST", "url": "/v1/completions", "body": good["body"]},  # no custom_id
        {**good},  # a duplicate custom_id
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/images/generations", "body": {}},
        {"custom_id": "streams", "method": "POST", "url": "/v1/completions", "body": {**good["body"], "stream": True}},
        {"custom_id": "no-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}},
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": "not a list"}},
    ]
    b = wait_done(c, submit(c, rows))
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (8, 1, 7)
    assert [r["custom_id"] for r in rows_of(c, b.output_file_id)] == ["good"]
    errors = rows_of(c, b.error_file_id)
    codes = [(r["custom_id"], r["error"]["code"], (r["response"] or {}).get("status_code")) for r in errors]
    assert codes == [(None, "invalid_json", None), (None, "missing_custom_id", None),
                     ("good", "duplicate_custom_id", None), ("wrong-url", "invalid_url", None),
                     ("streams", "stream_not_supported", None), ("no-model", "model_not_found", 404),
                     ("bad-body", "invalid_value", 400)]
    # the files: listed, deleted, gone
    listed = [f.id for f in c.files.list(purpose="batch_output")]
    assert b.output_file_id in listed and b.error_file_id in listed
    assert c.files.delete(b.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(b.input_file_id)
    assert b.input_file_id not in [f.id for f in c.files.list()]


def test_cancel_stops_new_work(mesh):
    _, url, model = mesh
    c = client(url)
    batch_id = submit(c, mixed_lines(model, 1000, max_tokens=400))
    deadline = time.monotonic() + 30
    while c.batches.retrieve(batch_id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert c.batches.cancel(batch_id).status == "cancelling"
    b = wait_done(c, batch_id)
    assert b.status == "cancelled" and b.cancelled_at
    done = b.request_counts.completed + b.request_counts.failed
    assert 1 <= done < 1000
    assert len(rows_of(c, b.output_file_id)) == b.request_counts.completed
    time.sleep(LEASE_S)
    assert c.batches.retrieve(batch_id).request_counts.completed == b.request_counts.completed
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch_id)


def test_a_gateway_killed_mid_batch_is_taken_over_without_duplicates(mesh):
    proc, url, model = mesh
    c = client(url)
    n = 100
    rows = mixed_lines(model, n, max_tokens=200)  # long enough to kill it mid-batch (asserted below)
    batch_id = submit(c, rows)
    deadline = time.monotonic() + 30
    while (counts := c.batches.retrieve(batch_id).request_counts).completed < 20:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert counts.completed < n  # mid-batch
    (gateway,) = [p for p in descendants(proc.pid) if b"gateway" in Path(f"/proc/{p}/cmdline").read_bytes()]
    argv = Path(f"/proc/{gateway}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{gateway}/environ").read_bytes().split(b"\0") if b"=" in kv)
    os.kill(gateway, signal.SIGKILL)
    restarted = subprocess.Popen(argv, env={k.decode(): v.decode() for k, v in env.items()})
    try:
        b = wait_done(c, batch_id, timeout=60, tolerate_errors=True)
        assert b.status == "completed", b
        out, err = rows_of(c, b.output_file_id), rows_of(c, b.error_file_id)
        assert not err
        ids = [r["custom_id"] for r in out]
        assert len(ids) == len(set(ids)) == n  # none lost, none twice
        assert (b.request_counts.completed, b.request_counts.failed) == (n, 0)
        # the restarted gateway took the batch over and ran the lines the dead one had not kept
        text = httpx.get(f"{url}/metrics", timeout=10).text
        ran = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('pdmesh_gateway_batch_lines_total{outcome="completed"}')]
        assert ran and 0 < ran[0] <= n - counts.completed
    finally:
        restarted.send_signal(signal.SIGINT)
        restarted.wait(30)
