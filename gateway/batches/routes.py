"""``/v1/batches``: create, retrieve, cancel, list; and ``install_batch_routes``, which installs
these, ``/v1/files`` and the runner (``gateway.batches.runner``) on the app.

A batch runs the lines of an uploaded JSONL file (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` and ``/v1/embeddings`` requests, mixed as the lines like) within a 24 h window:

    validating -> in_progress -> finalizing -> completed        (failed: the input is unusable)
                      |  cancel
                      v
                 cancelling -> cancelled                          (expired: the window ended)

Its state lives in JetStream (``gateway.batches.store``), so any gateway of the mesh answers for it
and runs it. A batch belongs to the tenant whose key created it (another tenant's ids are 404);
a tenant's unfinished batches hold at most ``--batch-max-queued-requests`` lines (429 past it).
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.batches.files import install_file_routes, owner_of, page, store_of
from gateway.batches.lines import BATCH_URLS
from gateway.batches.runner import BatchRunner
from gateway.batches.store import OPEN, BatchRecord
from gateway.errors import APIError
from gateway.metrics import BATCHES
from gateway.requests.bodies import parse_body
from mesh import metrics

WINDOW_S = 24 * 3600


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def install_batch_routes(app: FastAPI, gateway) -> None:
    """The Files and Batch APIs on ``app``, and the batch runner in its lifespan (after the
    gateway has joined the bus, before it leaves)."""
    runner = BatchRunner(gateway, app, gateway.config.batch)
    app.state.batches = runner
    install_file_routes(app)
    _install_lifespan(app, runner)

    schema = BatchCreate.model_json_schema()
    body_doc = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    @app.post("/v1/batches", openapi_extra=body_doc)
    async def create_batch(request: Request):
        return await _create(runner, request)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        rec = await store_of(request).get_batch(owner_of(request).owner, batch_id)
        if rec is None:
            raise APIError(404, f"no such batch: {batch_id!r}", "batch_id", "not_found")
        return rec.public()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        refused: list[str] = []

        def cancel(rec: BatchRecord) -> bool:
            if rec.status == "cancelling":
                return False
            if rec.status not in OPEN:
                refused.append(rec.status)
                return False
            rec.moved("cancelling", int(time.time()))
            return True

        rec = await store_of(request).update_batch(owner_of(request).owner, batch_id, cancel)
        if rec is None:
            raise APIError(404, f"no such batch: {batch_id!r}", "batch_id", "not_found")
        if refused:
            raise APIError(409, f"the batch is {refused[0]}: only a batch not finished can be cancelled",
                           "batch_id", "batch_not_cancellable")
        return rec.public()

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100),
                           after: str | None = Query(None, max_length=64)):
        batches = await store_of(request).list_batches(owner_of(request).owner)
        return page([b.public() for b in batches], limit, after)


async def _create(runner: BatchRunner, request: Request) -> dict:
    body = await _body(request)
    if body.completion_window != "24h":
        raise APIError(400, "completion_window must be \"24h\"", "completion_window")
    if body.endpoint not in BATCH_URLS:
        raise APIError(400, f"endpoint must be one of {', '.join(BATCH_URLS)}", "endpoint")
    if body.metadata and any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items()):
        raise APIError(400, "metadata keys are at most 64 characters, values at most 512", "metadata")
    store, run_as = store_of(request), owner_of(request)
    source = await store.get_file(run_as.owner, body.input_file_id)
    if source is None or source.purpose != "batch":
        raise APIError(404, f"no batch input file {body.input_file_id!r}", "input_file_id", "not_found")
    queued = sum(b.total for b in await store.list_batches(run_as.owner) if b.status in OPEN)
    limit = runner.config.max_queued_requests
    if queued + source.lines > limit:
        metrics.GATEWAY_REJECTED.labels("batch_requests").inc()
        raise APIError(429, f"this tenant has {queued} batch requests queued; {source.lines} more would pass "
                            f"the limit of {limit}", code="quota_exceeded")
    now = int(time.time())
    rec = BatchRecord(f"batch_{uuid.uuid4().hex}", run_as, body.endpoint, source.id, "24h", now,
                      now + WINDOW_S, metadata=body.metadata, total=source.lines)
    rec.moved("validating", now)
    await store.create_batch(rec)
    BATCHES.labels("validating").inc()
    runner.wake()
    return rec.public()


async def _body(request: Request) -> BatchCreate:
    return (await parse_body(request, BatchCreate))[0]


def _install_lifespan(app: FastAPI, runner: BatchRunner) -> None:
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            await runner.start()
            try:
                yield state
            finally:
                await runner.stop()

    app.router.lifespan_context = lifespan
