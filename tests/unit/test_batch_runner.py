"""A batch run on the in-memory store with a stand-in app: every line once into the files, a
takeover keeps what the first gateway kept, a cancel and an expiry end the run."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from gateway.batches.runner import BatchRun, BatchRunner
from gateway.batches.store import BatchRecord, BatchStore, FileRecord, RunAs
from gateway.limits import BatchConfig
from tests.helpers.fake_jetstream import FakeJetStream, FakeKV, FakeObjects

OWNER = RunAs("owner")


class App:
    """An ASGI app that answers every POST with its body echoed (status 400 when it asks)."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[str] = []
        self.delay = delay

    async def __call__(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.calls.append(body["tag"])
        await asyncio.sleep(self.delay)
        status = 400 if body.get("refuse") else 200
        payload = {"error": {"message": "refused", "code": "nope"}} if status == 400 else {"echo": body["tag"]}
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def runner(app: App, store: BatchStore, lease_s: float = 5.0) -> BatchRunner:
    gw = SimpleNamespace(router=None, membership=None, bus=None)
    r = BatchRunner(gw, app, BatchConfig(lease_s=lease_s, max_inflight=4))
    r.store = store
    r.governor.limit = 4
    return r


async def setup(n: int, expires_at: int = 10**10, refuse: tuple[int, ...] = ()) -> BatchStore:
    kv = FakeKV()
    store = BatchStore(kv, FakeObjects(), FakeJetStream(kv, "b"), "b")
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"tag": f"c{i}", **({"refuse": True} if i in refuse else {})}} for i in range(n)]
    data = b"\n".join(json.dumps(r).encode() for r in rows) + b"\nnot json\n"
    await store.put_file(FileRecord("file-in", OWNER.owner, "in.jsonl", len(data), 1, "batch", n + 1), data)
    await store.create_batch(BatchRecord("batch_1", OWNER, "/v1/completions", "file-in", "24h", 1, expires_at))
    return store


async def files_of(store: BatchStore, rec: BatchRecord) -> tuple[list[dict], list[dict]]:
    out = []
    for file_id in (rec.output_file_id, rec.error_file_id):
        data = store.files.data.get(file_id, b"") if file_id else b""
        out.append([json.loads(x) for x in data.splitlines()])
    return out[0], out[1]


async def test_a_run_keeps_every_line_once_and_writes_the_files():
    store, app = await setup(20, refuse=(3,)), App()
    r = runner(app, store)
    await BatchRun(r, "batch_1", OWNER.owner, await store.claim("batch_1", r.id, 0.0, 5.0)).execute()
    rec = await store.get_batch(OWNER.owner, "batch_1")
    assert rec.status == "completed" and (rec.total, rec.completed, rec.failed) == (21, 19, 2)
    out, err = await files_of(store, rec)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(20) if i != 3]
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [("c3", "nope"), (None, "invalid_json")]
    assert sorted(app.calls) == sorted(f"c{i}" for i in range(20))
    assert await store.active() == {} and await store.done_lines("batch_1") == {}


async def test_a_takeover_runs_only_the_lines_without_a_kept_result():
    store = await setup(10)
    first = runner(App(), store)
    await store.claim("batch_1", first.id, 0.0, 5.0)
    for i in range(6):  # the first gateway kept six results, then died
        await store.record_line("batch_1", i, b'{"custom_id":"c%d","status":200,"body":{"echo":"first"}}' % i)
    second_app = App()
    second = runner(second_app, store)
    rev = await store.claim("batch_1", second.id, 10.0, 5.0)  # its lease has lapsed
    assert rev is not None
    run = BatchRun(second, "batch_1", OWNER.owner, rev)
    await run.execute()
    assert sorted(second_app.calls) == ["c6", "c7", "c8", "c9"]
    out, _ = await files_of(store, await store.get_batch(OWNER.owner, "batch_1"))
    assert [x["response"]["body"]["echo"] for x in out] == ["first"] * 6 + ["c6", "c7", "c8", "c9"]


@pytest.mark.parametrize("how", ["cancel", "expire"])
async def test_a_cancel_or_the_window_ending_stops_new_lines(how):
    store = await setup(200, expires_at=0 if how == "expire" else 10**10)
    app = App(delay=0.05)
    r = runner(app, store, lease_s=0.15)
    task = asyncio.create_task(BatchRun(r, "batch_1", OWNER.owner, await store.claim("batch_1", r.id, 0.0, 1.0))
                               .execute())
    if how == "cancel":
        while len(app.calls) < 8:
            await asyncio.sleep(0.01)
        await store.update_batch(OWNER.owner, "batch_1", lambda rec: (rec.moved("cancelling", 2), True)[1])
    await asyncio.wait_for(task, 10)
    rec = await store.get_batch(OWNER.owner, "batch_1")
    assert rec.status == ("cancelled" if how == "cancel" else "expired")
    assert len(app.calls) < 100
    out, err = await files_of(store, rec)
    assert len(out) == rec.completed < 100
    if how == "expire":  # the lines never run are in the error file
        assert sum(1 for x in err if x["error"]["code"] == "batch_expired") == 200 - rec.completed
        assert [x["error"]["code"] for x in err if x["custom_id"] is None] == ["invalid_json"]
