"""Peer fetch between model decode workers (issue 20): both sides, a part of ``DecodeWorker``.

The router's decision for a request may name a peer that holds more of the prompt's
prefix than the chosen worker (``GenerateRequest.peer_fetch``). The chosen worker (the
requester) asks that peer (the holder) for those blocks before admitting the request:

    requester                                               holder
    generate (peer_fetch: source, hit, n)
      a buffer per channel (shm file / nats subject)
      KvFetchRequest(hashes past our run, transports) --->  pin the leading run it holds, any tier
                                                            (engine thread, between steps: bookkeeping)
                                                            disk blocks read, buffer mapped (a thread)
                                                            copy into the requester's buffer, 64 blocks
                                                            at a time (engine thread, between steps)
                                                            unpin                 (or: lease expiry)
      <------------------------------------------------------ KvFetchDone(num_blocks, tiers, transport)
      stage the bytes (PeerStage) -> admit: the engine's prefix walk onboards them as ``peer`` hits
    no reply within the timeout, a refusal, a dead holder, missing bytes: admit without them

On one host with the holder's blocks in shared memory (a CPU worker with the shm transport:
its KV pool and host-tier slots are /dev/shm files) the holder copies nothing: it *lends*
the pinned run (``KvFetchDone.lent``: where each block is in its files), the requester
copies the blocks out on its own cores and sends ``KvFetchRelease``, and the holder unpins
(or the lease does). Trust: the requester reads only the files the holder's registry card
advertises as its own (a reply naming another worker's pool is refused, logged and counted);
a release counts only with the fetch's ``release_key`` (random, in the reply only the
requester sees; compared in constant time); and the holder pins for at most
``--peer-pin-max-s``, whatever deadline the requester asks for. Its disk-tier blocks, in no shared file, it writes into the
requester's buffer on a thread. Otherwise (a GPU holder, a TP holder, the nats channel):

The holder's engine thread does the copy itself, between two steps, for at most
``COPY_SHARE`` of the last step's time per pause: on a CPU host a copy thread running
beside the step would take cores from the step's own threads (an OpenMP region waits for
its slowest thread), and the holder's ITL p99 rose 40% serving fetches that way
(python -m bench peer-serve); a whole fetch in one pause adds all of its copy to one step (60
tiny-small blocks: ~4.5 ms on a ~46 ms step). Budgeted, a large fetch spreads over steps.
The requester's engine thread does nothing for the transfer (the stage has its own lock).
The holder's event loop only awaits threads, the engine's calls and the bus.

Who frees what: the holder's pins, ``release`` once the bytes are written (or failed), or
``KvPins.expire`` past the lease (this worker calls it between steps). The requester's
buffers, ``FetchChannel.forget`` when the fetch is over however it ended; a holder never
writes the requester's KV blocks, only the fetch's own buffer, so a timed-out transfer
that is still writing cannot corrupt blocks that are reused (``kvstore/transfer/fetch.py``).
Staged blocks not taken by their admission expire with the stage's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from functools import partial

from decode.context import WorkerContext
from engine.core import EngineCore
from kvstore.cache import KVCache
from kvstore.hashing import block_hashes
from kvstore.tiers import DeviceBlock
from kvstore.transfer.fetch import FetchChannel, make_channels
from kvstore.transfer.shm import segment_name
from mesh.protocol import (
    GenerateRequest,
    KvFetchDone,
    KvFetchRelease,
    KvFetchRequest,
    LentRun,
    WorkerCard,
)
from mesh.registry import Membership

log = logging.getLogger(__name__)

PAGE = 4096
COPY_SHARE = 0.08  # of the last step's time: what the holder's engine spends copying between two steps
COPY_CHUNK = 8  # blocks per copy call (tiny-small: 3.2 MB, ~0.4-0.8 ms on one CPU core)


class PeerFetch:
    """A model decode worker's peer fetch: it serves its blocks to peers and fetches theirs."""

    def __init__(self, ctx: WorkerContext, timeout: float):
        if ctx.engine.tiers is None or ctx.engine.tiers.copier is None:
            raise ValueError("peer fetch needs a host KV tier (--host-kv-gb or --host-kv-blocks)")
        self.ctx = ctx
        self.engine = ctx.engine
        self.timeout = timeout
        self.block_bytes = ctx.engine.kv_cache.spec.block_bytes
        self.channels: dict[str, FetchChannel] = {}
        # One send at a time (as a NIC sends): the copies of concurrent fetches would take that
        # many cores from the engine's own steps at once, and concurrent nats sends would crowd
        # this event loop (each chunk is encoded and written here); queued fetches wait within
        # their deadline (measured: docs/benchmarks.md, "peer-serve").
        self._sending = asyncio.Semaphore(1)
        self.lendable = self._lend_files()  # {"kv", "slots", "spec"}: a peer on this host reads our blocks
        self._lent: dict[str, str] = {}  # fetch id -> its release key, while the pins wait for the release
        self.max_pin_s = ctx.settings.peer_pin_max_s  # our own cap on a pin's lease
        self.membership: Membership | None = None  # the holders' cards: which files are theirs

    def _lend_files(self) -> dict | None:
        kv, copier = self.engine.kv_cache, self.engine.tiers.copier
        if not isinstance(kv, KVCache) or kv.shm_path is None or copier.shm_path is None:
            return None
        return {"kv": segment_name(kv.shm_path), "slots": segment_name(copier.shm_path), "spec": kv.spec.to_dict()}

    async def start(self, stack: AsyncExitStack, membership: Membership) -> None:
        ctx, s, model = self.ctx, self.ctx.bus.subjects, self.engine.model_name
        self.membership = membership
        self.channels = make_channels(ctx.transports, bus=ctx.bus, model=model, worker_id=ctx.worker_id)
        await ctx.subscribe(stack, s.kv_fetch(model, ctx.worker_id), self._on_fetch, KvFetchRequest)
        await ctx.subscribe(stack, s.kv_fetch_release(model, ctx.worker_id), self._on_release, KvFetchRelease)

    def fill_card(self, card) -> None:
        card.serves_kv_fetch = True
        card.fetches_kv = True
        if self.lendable is not None and "shm" in card.transports:  # the only files a peer reads from us
            card.transports["shm"].update(kv=self.lendable["kv"], slots=self.lendable["slots"])

    # -- requester -----------------------------------------------------------------------------
    def _wanted(self, req: GenerateRequest) -> tuple[str, list[int]]:
        """The peer and the hashes the router's plan says to fetch (past our run as it saw it; if we
        hold less, the admission's walk stops at the gap and prefills the rest)."""
        plan, bs = req.peer_fetch, self.engine.block_size
        if plan is None or plan.fetch_source in ("", self.ctx.worker_id) or plan.fetch_blocks <= 0:
            return "", []
        end = min((len(req.token_ids) - 1) // bs, plan.hit_blocks + plan.fetch_blocks)
        if end <= plan.hit_blocks:
            return "", []
        return plan.fetch_source, block_hashes(req.token_ids[: end * bs], bs, self._seed(req))[plan.hit_blocks:]

    def _seed(self, req: GenerateRequest):
        """The request's own block-hash seed: its scope and adapter name the blocks it may fetch."""
        return self.engine.seed_for(req.cache_scope, req.adapter or None)

    async def fetch_for(self, req: GenerateRequest) -> int:
        """Stage the blocks the router's plan names (the request's tokens are valid ids); returns
        how many were staged (0 on any failure: the request prefills them)."""
        source, want = self._wanted(req)
        if not want:
            return 0
        counters = self.ctx.counters
        counters.bump("peer_fetch_requests")
        fetch_id = uuid.uuid4().hex[:16]
        try:
            n = await self._fetch(req, source, want, fetch_id)
        except Exception as e:  # no responders (the holder is gone), a timeout, a refusal, missing bytes
            counters.bump("peer_fetch_failed")
            log.info("peer fetch of %s from %s failed (%s: %s): prefilling", req.request_id, source,
                     type(e).__name__, e)
            return 0
        finally:
            for ch in self.channels.values():
                await ch.forget(fetch_id)
        counters.bump("peer_fetch_ok" if n else "peer_fetch_empty")
        counters.bump("peer_fetch_blocks", n)
        return n

    async def _fetch(self, req: GenerateRequest, source: str, want: list[int], fetch_id: str) -> int:
        bb, bus = self.block_bytes, self.ctx.bus
        transports = {name: await ch.params(fetch_id, len(want) * bb) for name, ch in self.channels.items()}
        msg = KvFetchRequest(req.request_id, req.model, self.ctx.worker_id, want, time.time() + self.timeout,
                             transports, fetch_id=fetch_id, block_bytes=bb)
        done = await bus.request(bus.subjects.kv_fetch(req.model, source), msg, KvFetchDone, self.timeout)
        if not done.ok:
            raise RuntimeError(f"the holder refused: {done.error}")
        n = min(done.num_blocks, len(want))
        channel = self.channels.get(done.transport)
        try:
            if done.lent is not None:
                self._check_lent(source, done.lent, req.request_id)
            lent = done.lent.to_dict() if done.lent is not None else None
            data = None if channel is None or n <= 0 else await channel.take(fetch_id, n * bb, lent)
        finally:
            if done.lent is not None:  # the run stays pinned for us until we say we have read it
                await self._release(source, fetch_id, req.model, done.release_key)
        if n <= 0:
            return 0
        if data is None:
            raise RuntimeError(f"the bytes of {n} blocks are not in the {done.transport or 'unnamed'} buffer")
        self.engine.stage_peer_blocks(want[:n], [data[i * bb : (i + 1) * bb] for i in range(n)])
        self.ctx.counters.bump(f"peer_fetch_via_{done.transport}")
        return n

    def _check_lent(self, source: str, lent: LentRun, rid: str) -> None:
        """A lent run is read only from the files the holder's card advertises as its own: a reply
        naming any other (another worker's pool) is refused, logged and counted."""
        card = self.membership.get(source) if self.membership is not None else None
        if lent_files(card) != (lent.kv, lent.slots):
            self.ctx.refuse("unadvertised_lent_files", rid,
                            f"{source} lent blocks in {lent.kv!r} and {lent.slots!r}, not files its card names")
            raise RuntimeError(f"{source} lent blocks in files that are not its own")

    async def _release(self, source: str, fetch_id: str, model: str, key: str) -> None:
        with contextlib.suppress(Exception):  # a holder gone or unreachable: its lease unpins
            await self.ctx.bus.publish(self.ctx.bus.subjects.kv_fetch_release(model, source),
                                       KvFetchRelease(self.ctx.worker_id, fetch_id, key))

    # -- holder --------------------------------------------------------------------------------
    async def _on_release(self, msg: KvFetchRelease, raw) -> None:
        fetch_id = f"{msg.requester}:{msg.fetch_id}"
        key = self._lent.get(fetch_id)
        if key is None:
            return  # not a run we lent (or released already): a stray release never unpins a copy under way
        if not hmac.compare_digest(key.encode(), msg.release_key.encode()):
            self.ctx.refuse("unbound_fetch_release", fetch_id, "a KvFetchRelease without its fetch's release key")
            return
        del self._lent[fetch_id]
        await self.ctx.loop.call(partial(EngineCore.unpin_run, fetch_id=fetch_id))
        self.ctx.counters.bump("peer_serve_released")

    async def _on_fetch(self, req: KvFetchRequest, raw) -> None:
        if not raw.reply:
            log.warning("kv_fetch %s without a reply subject: dropped", req.request_id)
            return
        self.ctx.spawn(self._serve(req, raw.reply))

    def _refusal(self, req: KvFetchRequest) -> str:
        if req.model != self.engine.model_name:
            return f"model {req.model!r} is not served here"
        if req.block_bytes and req.block_bytes != self.block_bytes:
            return f"block layout differs ({req.block_bytes} bytes per block here {self.block_bytes})"
        if not req.hashes or req.deadline <= time.time():
            return "nothing to send in time"
        return ""

    def _lease(self, req: KvFetchRequest) -> float:
        """Seconds to pin for: what is left of the requester's deadline, at most our own cap."""
        return min(req.deadline - time.time(), self.max_pin_s)

    def _channel(self, transports: dict[str, dict]) -> tuple[FetchChannel, dict] | None:
        for name, params in transports.items():  # the requester's order: best first
            ch = self.channels.get(name)
            if ch is not None and isinstance(params, dict) and ch.usable(params):
                return ch, params
        return None

    async def _serve(self, req: KvFetchRequest, reply: str) -> None:
        started = time.monotonic()
        ctx = self.ctx
        counters, bus = ctx.counters, ctx.bus
        counters.bump("peer_serve_requests")
        error = self._refusal(req)
        picked = None if error else self._channel(req.transports)
        if not error and picked is None:
            error = "no transport of the requester's is usable from here"
        if error:
            counters.bump("peer_serve_refused")
            await bus.publish(reply, KvFetchDone(req.request_id, ctx.worker_id, False, error=error))
            return
        channel, params = picked
        fetch_id = f"{req.requester}:{req.fetch_id or req.request_id}"
        until = time.time() + self._lease(req)
        try:
            run = await ctx.loop.call(partial(_pin, fetch_id, req.hashes, until))
        except ValueError as e:  # the same fetch twice, or its lease ran out meanwhile
            await bus.publish(reply, KvFetchDone(req.request_id, ctx.worker_id, False, error=str(e)))
            return
        done = KvFetchDone(req.request_id, ctx.worker_id, True)
        lend = self.lendable is not None and channel.name == "shm" and params.get("read") is True
        try:
            if len(run):
                move = self._lend(run, fetch_id, channel, params, done, until) if lend else \
                    self._send(run, fetch_id, channel, params, done)
                await asyncio.wait_for(move, max(0.0, until - time.time()))
        except Exception as e:  # a bad buffer, a disk read that failed, past the deadline
            done = KvFetchDone(req.request_id, ctx.worker_id, False, error=f"{type(e).__name__}: {e}")
        finally:
            if done.ok and done.lent is not None:  # released by the requester (``_on_release``) or the lease
                self._lent = {f: k for f, k in self._lent.items() if self.engine.is_pinned(f)}  # forget lapsed ones
                self._lent[fetch_id] = done.release_key
            else:
                ctx.loop.call(partial(EngineCore.unpin_run, fetch_id=fetch_id))  # not awaited: also runs on cancellation
        done.transfer_ms = (time.monotonic() - started) * 1000
        if done.ok:
            counters.bump("peer_serve_blocks", done.num_blocks)
            for tier, k in done.tiers.items():
                counters.bump(f"peer_serve_{tier}_blocks", k)
        else:
            counters.bump("peer_serve_failed")
        await bus.publish(reply, done)

    async def _lend(self, run, fetch_id: str, channel: FetchChannel, params: dict, done: KvFetchDone,
                    until: float) -> None:
        """Say where the pinned run's blocks are in our shared files; only disk blocks (in no shared
        file) are written, into the requester's buffer (both on a thread: disk reads, a pwrite)."""
        sources = await asyncio.to_thread(self.engine.pinned_sources, fetch_id)
        where, index, rows = [], [], []
        for i, src in enumerate(sources):
            if isinstance(src, DeviceBlock):
                where.append(0)
                index.append(src.block_id)
            elif isinstance(src, int):
                where.append(1)
                index.append(src)
            else:
                where.append(2)
                index.append(i)
                rows.append((i, src))
        if rows:
            await channel.write_rows(params, rows, self.block_bytes)
        n = len(sources)
        done.lent = LentRun(self.lendable["kv"], self.lendable["slots"], self.lendable["spec"], where, index, until)
        done.release_key = secrets.token_urlsafe(16)  # only the requester sees this reply
        done.transport = channel.name
        done.num_blocks = n
        done.transfer_bytes = n * self.block_bytes
        done.tiers = dict(Counter(run.tiers[:n]))

    async def _send(self, run, fetch_id: str, channel: FetchChannel, params: dict, done: KvFetchDone) -> None:
        """The pinned run into the requester's buffer: disk reads and the mapping on a thread, the
        copies on the engine thread between steps (``_copy_some``)."""
        import torch

        copier = self.engine.tiers.copier

        def prepare():  # on a thread: disk reads, mapping the requester's buffer (shm)
            sources = self.engine.pinned_sources(fetch_id)
            dest = channel.target(params, len(run), copier.block_shape, copier.dtype)
            direct = dest is not None  # mapped with its pages in place (the channel's job)
            if dest is None:
                dest = torch.empty((len(sources), *copier.block_shape), dtype=copier.dtype, pin_memory=copier.cuda)
                # fault the pages in here: a first write to fresh memory costs the kernel more than
                # the copy itself (3.4 vs 0.8 ms per 16 tiny-small blocks), and the copy runs between steps
                dest.view(-1)[:: PAGE // dest.element_size()].zero_()
            return sources, dest, direct

        async with self._sending:
            sources, data, direct = await asyncio.to_thread(prepare)
            n = len(sources)
            if n == 0:
                return
            copied = 0
            while copied < n:
                copied = await self.ctx.loop.call(partial(self._copy_some, copier, sources, data, copied))
            if direct:  # already in the requester's buffer
                done.transfer_bytes = n * copier.block_bytes
            else:
                payload = memoryview(data[:n].reshape(-1).view(torch.uint8).numpy())
                done.transfer_bytes = await channel.send(fetch_id, params, payload)
        done.transport = channel.name
        done.num_blocks = n
        done.tiers = dict(Counter(run.tiers[:n]))

    def _copy_some(self, copier, sources: list, data, start: int, engine) -> int:
        """Engine thread, between two steps: copy blocks from ``start`` for at most ``COPY_SHARE``
        of the last step's time (at least one chunk; all of them when the engine is idle).
        Returns where the next pause starts."""
        budget = COPY_SHARE * self.ctx.loop.step_seconds if engine.has_work else math.inf
        t0 = time.perf_counter()
        i, n = start, len(sources)
        while i < n:
            j = min(n, i + COPY_CHUNK)
            copier.stage(sources[i:j], data[i:j])
            i = j
            if time.perf_counter() - t0 >= budget:
                break
        return i


def _pin(fetch_id: str, hashes: list[int], until: float, engine: EngineCore):
    """Engine thread: pin the run until ``until`` (unix seconds) as of now (ValueError when it has
    passed while the request waited for the step to end)."""
    return engine.pin_run(fetch_id, hashes, until - time.time())


def lent_files(card: WorkerCard | None) -> tuple[str, str] | None:
    """The (KV, slots) file names a holder's card advertises as its own (None: none)."""
    shm = card.transports.get("shm", {}) if card is not None else {}
    kv, slots = shm.get("kv"), shm.get("slots")
    return (kv, slots) if isinstance(kv, str) and isinstance(slots, str) else None
