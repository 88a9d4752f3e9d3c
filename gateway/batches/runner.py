"""The batch runner of one gateway: claims unfinished batches, runs their lines, writes their files.

    every second (or when a batch is created here): for each active batch nobody holds,
        take its lease (compare-and-set) and run it:
            validating  -> read and check the input file, count its lines -> in_progress
            in_progress -> every line without a kept result, through the governor, as an
                           in-process request (``dispatch``); keep each result once
            -> finalizing -> output and error files from the kept results -> completed
    while running: renew the lease every lease/3, read the batch's status (a cancel stops new
    lines and cancels the ones in flight; the 24 h window ending expires it), publish the counts.

Exactly once, here: every line's result is kept at most once (``BatchStore.record_line`` creates
its key; a second result is dropped), and a batch is finished only when every line has one, so
each line appears once in the output or error file. A line in flight when its gateway dies (or
loses its lease) runs again on the gateway that takes the batch over: the model may see it twice,
but the client gets one result. Lines already kept are not run again.

Who stops what: ``stop`` cancels the poll, the governor and every run; a run's ``finally``
cancels its lines in flight (cancelling them on the workers) and lets its lease lapse early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid

import msgspec

from gateway.batches.dispatch import call_route
from gateway.batches.governor import TICK, Governor
from gateway.batches.lines import (
    Line,
    LineResult,
    count_kept,
    encode_result,
    not_run,
    parse_lines,
    render_files,
)
from gateway.batches.store import FINAL, BatchRecord, BatchStore, FileRecord, Lease
from gateway.limits import BatchConfig
from gateway.metrics import BATCH_INFLIGHT, BATCH_LINES, BATCH_RUNNING, BATCHES
from mesh.procutil import cancel_and_wait

log = logging.getLogger(__name__)

POLL_S = 1.0
RETRY_STATUSES = (429, 502, 503)  # the mesh is busy or between workers: the line runs again later
MAX_ATTEMPTS = 6


class BatchRunner:
    def __init__(self, gateway, app, config: BatchConfig):
        self.gateway = gateway
        self.app = app  # the FastAPI app: lines are requests to it
        self.config = config
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the lease holder
        self.store: BatchStore | None = None
        self.governor = Governor(config.max_inflight, config.headroom)
        self.running: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._wake: asyncio.Event | None = None

    def wake(self) -> None:
        """Look for new batches now (one was created here)."""
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._poll(), name="batch-poll"),
                       asyncio.create_task(self._govern(), name="batch-governor")]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks + list(self.running.values()))

    async def _poll(self) -> None:
        while True:
            try:
                if self.store is None:
                    self.store = await BatchStore.open(self.gateway.bus)
                await self._claim()
            except Exception as e:  # JetStream away for a moment: try again next round
                log.warning("batch runner: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

    async def _claim(self) -> None:
        for batch_id, owner in (await self.store.active()).items():
            if batch_id in self.running:
                continue
            rev = await self.store.claim(batch_id, self.id, time.time(), self.config.lease_s)
            if rev is None:
                continue
            task = asyncio.create_task(BatchRun(self, batch_id, owner, rev).execute(), name=f"batch-{batch_id}")
            self.running[batch_id] = task
            task.add_done_callback(lambda t, b=batch_id: self.running.pop(b, None))

    async def _govern(self) -> None:
        while True:
            slept = time.monotonic()
            await asyncio.sleep(TICK)
            lag = time.monotonic() - slept - TICK  # how late the loop is: this gateway's CPU
            gw = self.gateway
            loads = []
            if gw.router is not None and gw.membership is not None:
                loads = [r for w, r in list(gw.router.loads.items())
                         if r.role == "decode" and gw.membership.get(w) is not None]
            await self.governor.tick(loads, lag)
            BATCH_INFLIGHT.labels("limit").set(self.governor.limit)
            BATCH_INFLIGHT.labels("running").set(self.governor.inflight)


class BatchRun:
    """One batch on this gateway, while it holds the lease."""

    def __init__(self, runner: BatchRunner, batch_id: str, owner: str, rev: int):
        self.runner = runner
        self.store: BatchStore = runner.store
        self.config = runner.config
        self.batch_id = batch_id
        self.owner = owner
        self.rev = rev
        self.renewed = time.time()
        self.stopping: str | None = None  # cancelled | expired | lost
        self.completed = self.failed = 0
        self.inflight: set[asyncio.Task] = set()
        self.key = None
        self.done: dict[int, bytes] | None = None  # the kept results, as last read

    async def execute(self) -> None:
        BATCH_RUNNING.inc()
        keeper = None
        try:
            rec = await self.store.get_batch(self.owner, self.batch_id)
            if rec is None or rec.status in FINAL:  # finished by a gateway that died before tidying up
                await self.store.retire(self.batch_id)
                return
            self.key = rec.run_as.api_key()
            keeper = asyncio.create_task(self._keep_lease(rec.expires_at), name=f"lease-{self.batch_id}")
            data = await self._input(rec)
            if data is None:
                return
            lines = await asyncio.to_thread(parse_lines, data)  # 10,000 lines: off the event loop
            if rec.status == "validating":
                rec = await self._start(lines)
                if rec is None or rec.status == "failed":
                    return
            if rec.status == "cancelling":
                self.stopping = "cancelled"
            if await self._run_lines(lines) or self.stopping in ("cancelled", "expired"):
                await self._finish(lines)
            elif self.stopping is None:  # results the store would not keep: let go, run them again later
                log.warning("batch %s: lines without a kept result; trying again", self.batch_id)
        finally:
            await cancel_and_wait([*self.inflight, *([keeper] if keeper else [])])
            if self.stopping != "lost":
                with contextlib.suppress(Exception):  # let another gateway take it at once
                    await asyncio.wait_for(self._lapse(), 2.0)
            BATCH_RUNNING.dec()

    # -- the lease, the status, the counts ----------------------------------------------------
    async def _keep_lease(self, expires_at: int) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            now = time.time()
            try:
                rev = await self.store.renew(self.batch_id, self.runner.id, self.rev, now, self.config.lease_s)
                rec = await self.store.update_batch(self.owner, self.batch_id, self._counts)
            except Exception as e:
                log.warning("batch %s: lease not renewed (%s)", self.batch_id, e)
                if now - self.renewed < self.config.lease_s * 2 / 3:
                    continue
                rev = None
            if rev is None:
                log.warning("batch %s: lost the lease; another gateway goes on with it", self.batch_id)
                self._stop("lost")
                return
            self.rev, self.renewed = rev, now
            if rec is not None and rec.status == "cancelling":
                self._stop("cancelled")
            elif now >= expires_at:
                self._stop("expired")

    def _stop(self, why: str) -> None:
        if self.stopping is None or why == "lost":
            self.stopping = why
        for task in self.inflight:
            task.cancel()

    def _counts(self, rec: BatchRecord) -> bool:
        if (rec.completed, rec.failed) == (self.completed, self.failed) or rec.status in FINAL:
            return False
        rec.completed, rec.failed = self.completed, self.failed
        return True

    async def _lapse(self) -> None:
        await self.store.kv.update(f"lease.{self.batch_id}", msgspec.json.encode(Lease(self.runner.id, 0.0)),
                                   last=self.rev)

    # -- states -------------------------------------------------------------------------------
    async def _input(self, rec: BatchRecord) -> bytes | None:
        source = await self.store.get_file(self.owner, rec.input_file_id)
        if source is None:
            await self._fail("missing_file", f"the input file {rec.input_file_id} was deleted")
            return None
        return await self.store.file_data(source)

    async def _start(self, lines: list[Line]) -> BatchRecord | None:
        if not lines:
            await self._fail("empty_file", "the input file has no lines")
            return None

        def begin(rec: BatchRecord) -> bool:
            rec.total = len(lines)
            if rec.status == "validating":
                rec.moved("in_progress", int(time.time()))
            return True

        rec = await self.store.update_batch(self.owner, self.batch_id, begin)
        if rec is not None and rec.status == "in_progress":
            BATCHES.labels("in_progress").inc()
        return rec

    async def _fail(self, code: str, message: str) -> None:
        def fail(rec: BatchRecord) -> bool:
            rec.moved("failed", int(time.time()))
            rec.errors = [{"code": code, "message": message, "param": "input_file_id", "line": None}]
            return True

        await self.store.update_batch(self.owner, self.batch_id, fail)
        BATCHES.labels("failed").inc()
        await self.store.retire(self.batch_id)

    async def _run_lines(self, lines: list[Line]) -> bool:
        """Every line without a kept result, until all have one (True) or the run stops. A line
        whose result could not be kept (the store was away) is tried again on the next pass."""
        for _ in range(3):
            done = await self.store.done_lines(self.batch_id)
            self.completed, self.failed = await asyncio.to_thread(count_kept, done)
            todo = [line for line in lines if line.index not in done]
            if not todo:
                self.done = done
                return True
            if self.stopping:
                return False
            for line in todo:
                if self.stopping:
                    break
                if not line.runnable:
                    await self._keep(line, not_run(line))
                    continue
                await self.runner.governor.acquire()
                if self.stopping:
                    await self.runner.governor.release()
                    break
                task = asyncio.create_task(self._line(line))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)
            if self.inflight:
                await asyncio.wait(list(self.inflight))
        self.done = await self.store.done_lines(self.batch_id)
        return not self.stopping and all(line.index in self.done for line in lines)

    async def _line(self, line: Line) -> None:
        try:
            result = await self._call(line)
        finally:
            await self.runner.governor.release()
        await self._keep(line, result)

    async def _call(self, line: Line) -> LineResult:
        for attempt in range(MAX_ATTEMPTS):
            status, body = await call_route(self.runner.app, line.url, line.body, self.key, self.config.line_timeout)
            if status not in RETRY_STATUSES or attempt == MAX_ATTEMPTS - 1:
                break
            await asyncio.sleep(min(30.0, 0.5 * 2 ** attempt))
        return _result(line, status, body)

    async def _keep(self, line: Line, result: LineResult) -> None:
        for attempt in range(3):
            try:
                kept = await self.store.record_line(self.batch_id, line.index, encode_result(result))
            except Exception as e:
                log.warning("batch %s line %d: result not kept yet (%s)", self.batch_id, line.index, e)
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            if kept:  # else another gateway kept its result of the line first: that one counts
                self.completed += result.ok
                self.failed += not result.ok
                BATCH_LINES.labels("completed" if result.ok else "failed").inc()
            return

    async def _finish(self, lines: list[Line]) -> None:
        final = self.stopping or "completed"
        now = int(time.time())
        if final == "completed":
            await self.store.update_batch(self.owner, self.batch_id, lambda r: (r.moved("finalizing", now), True)[1])
            BATCHES.labels("finalizing").inc()
        # the results _run_lines read last, when they cover every line; else (a cancel) read them now
        done = self.done if final == "completed" and self.done is not None else \
            await self.store.done_lines(self.batch_id)
        out, err, completed, failed, usage = await asyncio.to_thread(render_files, lines, done, final == "expired")
        output_id = await self._write(out, "output")
        error_id = await self._write(err, "error")

        def close(rec: BatchRecord) -> bool:
            rec.moved(final, int(time.time()))
            rec.completed, rec.failed, rec.usage = completed, failed, usage
            rec.output_file_id, rec.error_file_id = output_id, error_id
            return True

        await self.store.update_batch(self.owner, self.batch_id, close)
        BATCHES.labels(final).inc()
        await self.store.retire(self.batch_id)

    async def _write(self, data: bytes, kind: str) -> str | None:
        """The output or error file (same id on every try: a finish run twice writes it once)."""
        if not data:
            return None
        rec = FileRecord(f"file-{self.batch_id.removeprefix('batch_')}-{kind}", self.owner,
                         f"{self.batch_id}_{kind}.jsonl", len(data), int(time.time()), "batch_output")
        await self.store.put_file(rec, data)
        return rec.id


def _result(line: Line, status: int, body: bytes) -> LineResult:
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return LineResult(line.custom_id, status or 500, code="invalid_response",
                          message="the route answered with a body that is not JSON")
    if 200 <= status < 300:
        return LineResult(line.custom_id, status, msgspec.Raw(body))
    error = parsed.get("error") if isinstance(parsed, dict) else None
    error = error if isinstance(error, dict) else {}
    return LineResult(line.custom_id, status, msgspec.Raw(body), str(error.get("code") or "request_failed"),
                      str(error.get("message") or f"status {status}"))
