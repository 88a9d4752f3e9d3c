"""The mocker's decode worker: a ``DecodeWorker`` on ``MockEngine`` that also simulates peer fetch.

Peer fetch (issue 20, phase A): when the router's decision for a request names a peer
that holds more of the prompt's prefix than this worker, this worker asks the peer for
those blocks before admitting the request, and the admission onboards them as a prefix
hit from the ``peer`` source. No bytes move: the holder pins the blocks
(``kvstore.pins``), waits out the transfer time its timing model gives (its NIC sends
one fetch at a time), unpins, and answers. Everything else is real: the bus messages
(``KvFetchRequest`` / ``KvFetchDone``), the pins, the holder's engine reaching a step
boundary before it can pin, the hit counters and KV events on both sides.

    requester (this worker)                          holder
    generate -> wait for the router's decision (<= hint_wait)
             -> decision names a source: KvFetchRequest(hashes past our run) --------->
                                                     pin the leading run it holds (between steps)
                                                     sleep: TimingModel.fetch_ms / speedup
                                                     unpin                     (or: lease expiry)
             <------------------------------------- KvFetchDone(num_blocks, tiers)
             stage the blocks (PeerStage) -> admit: onboarded like a host hit (no step time: paid)
    no reply within fetch_timeout, a refusal, no responders: admit without them (prefill)

The decision comes in ``GenerateRequest.peer_fetch`` (the gateway puts it there); a request
without one (sent by a client that routes for itself) waits up to ``hint_wait`` for it on
``router.decisions``. The model worker's peer fetch (real bytes) is ``decode/peerfetch.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import AsyncExitStack
from functools import partial

from decode.worker import DecodeWorker
from engine.core import EngineCore
from kvstore.hashing import block_hashes
from mesh.protocol import GenerateRequest, KvFetchDone, KvFetchRequest, RouterDecision
from mocker.engine import MockConfig

log = logging.getLogger(__name__)

HINT_TTL = 30.0  # seconds a decision about a request that has not arrived yet is kept


class FetchHints:
    """The router's decisions about requests sent to one worker, by request id."""

    def __init__(self, worker_id: str, ttl: float = HINT_TTL):
        self.worker_id = worker_id
        self.ttl = ttl
        self._got: OrderedDict[str, tuple[float, RouterDecision]] = OrderedDict()
        self._waiters: dict[str, asyncio.Future] = {}

    def add(self, d: RouterDecision) -> None:
        if d.worker_id != self.worker_id:
            return
        waiter = self._waiters.pop(d.request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(d)
            return
        now = time.monotonic()
        self._got.pop(d.request_id, None)
        self._got[d.request_id] = (now, d)
        while self._got and next(iter(self._got.values()))[0] < now - self.ttl:
            self._got.popitem(last=False)

    async def wait(self, request_id: str, timeout: float) -> RouterDecision | None:
        got = self._got.pop(request_id, None)
        if got is not None:
            return got[1]
        fut = self._waiters[request_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return None
        finally:
            self._waiters.pop(request_id, None)


class MockWorker(DecodeWorker):
    def __init__(self, settings):
        super().__init__(settings)
        self.mock: MockConfig = settings.engine
        self.hints = FetchHints(self.worker_id)
        self._nic_free_at = 0.0  # monotonic: when this worker's NIC has sent what it was asked

    async def setup(self, stack: AsyncExitStack) -> None:
        await super().setup(stack)
        ctx, s, model = self.ctx, self.bus.subjects, self.engine.model_name
        await ctx.subscribe(stack, s.kv_fetch(model, self.worker_id), self._on_fetch, KvFetchRequest)
        if self.mock.peer_fetch:
            await ctx.subscribe(stack, s.router_decisions(), self._on_decision, RouterDecision)

    def card(self):
        card = super().card()
        card.kv_costs = self.engine.kv_costs.to_dict()
        card.serves_kv_fetch = True
        card.fetches_kv = self.mock.peer_fetch
        return card

    def load(self, engine):
        engine.expire_pins()  # runs between steps: a fetch whose sender vanished frees its pins here
        return super().load(engine)

    # -- requester ------------------------------------------------------------------------
    async def _on_decision(self, d: RouterDecision, raw) -> None:
        self.hints.add(d)

    async def on_generate(self, req: GenerateRequest, raw) -> None:
        if self.mock.peer_fetch and raw.reply and self.status == "ready" and req.model == self.engine.model_name:
            await self._fetch_for(req)
        await super().on_generate(req, raw)

    async def _fetch_for(self, req: GenerateRequest) -> None:
        """Stage the blocks the router's decision says a peer can send (nothing on any failure)."""
        hint = req.peer_fetch or await self.hints.wait(req.request_id, self.mock.hint_wait)
        if hint is None:
            self.counters.bump("peer_fetch_no_decision")
            return
        source = hint.fetch_source
        if not source or source == self.worker_id or hint.fetch_blocks <= 0:
            return
        bs = self.engine.block_size
        end = min((len(req.token_ids) - 1) // bs, hint.hit_blocks + hint.fetch_blocks)
        try:
            hashes = block_hashes(req.token_ids[: end * bs], bs, self.engine.seed_for(req.cache_scope, req.adapter or None))
        except (OverflowError, TypeError, ValueError):
            return  # not token ids: the admission answers the error
        # Past our own run as the router saw it (asking the engine would wait for its next step
        # boundary): if we hold less, the admission's walk stops at the gap and prefills the rest.
        want = hashes[hint.hit_blocks:]
        if not want:
            return
        self.counters.bump("peer_fetch_requests")
        timeout = self.mock.fetch_timeout
        msg = KvFetchRequest(req.request_id, req.model, self.worker_id, want, deadline=time.time() + timeout)
        try:
            done = await self.bus.request(self.bus.subjects.kv_fetch(req.model, source), msg, KvFetchDone, timeout)
        except Exception as e:  # no responders (the holder is gone), a timeout: prefill instead
            self.counters.bump("peer_fetch_failed")
            log.info("peer fetch of %s from %s failed (%s): prefilling", req.request_id, source, type(e).__name__)
            return
        if not done.ok or done.num_blocks <= 0:
            self.counters.bump("peer_fetch_failed" if not done.ok else "peer_fetch_empty")
            return
        n = min(done.num_blocks, len(want))
        self.engine.stage_peer_blocks(want[:n])  # the stage has its own lock: no wait for a step boundary
        self.counters.bump("peer_fetch_ok")
        self.counters.bump("peer_fetch_blocks", n)

    # -- holder ---------------------------------------------------------------------------
    async def _on_fetch(self, req: KvFetchRequest, raw) -> None:
        if not raw.reply:
            log.warning("kv_fetch %s without a reply subject: dropped", req.request_id)
            return
        self.ctx.spawn(self._serve(req, raw.reply))

    async def _serve(self, req: KvFetchRequest, reply: str) -> None:
        started = time.monotonic()
        lease = min(req.deadline - time.time(), self.settings.peer_pin_max_s)  # our cap, whatever it asks
        if req.model != self.engine.model_name or lease <= 0 or not req.hashes:
            why = "wrong model" if req.model != self.engine.model_name else "nothing to send in time"
            await self.bus.publish(reply, KvFetchDone(req.request_id, self.worker_id, False, error=why))
            return
        fetch_id = f"{req.request_id}:{req.requester}"
        try:
            run = await self.loop.call(partial(EngineCore.pin_run, fetch_id=fetch_id, hashes=req.hashes, lease_s=lease))
        except ValueError as e:  # the same fetch twice
            await self.bus.publish(reply, KvFetchDone(req.request_id, self.worker_id, False, error=str(e)))
            return
        try:
            if len(run):
                seconds = self.mock.timing.fetch_ms(run.tier_counts, self.engine.block_size) / 1000 / self.mock.speedup
                now = time.monotonic()
                self._nic_free_at = max(now, self._nic_free_at) + seconds  # one send at a time
                await asyncio.sleep(self._nic_free_at - now)
        finally:
            self.loop.call(partial(EngineCore.unpin_run, fetch_id=fetch_id))  # not awaited: also runs on cancellation
        ok = time.time() <= req.deadline
        self.counters.bump("peer_serve_requests")
        if ok:
            self.counters.bump("peer_serve_blocks", len(run))
        await self.bus.publish(reply, KvFetchDone(
            req.request_id, self.worker_id, ok, num_blocks=len(run) if ok else 0, tiers=dict(run.tier_counts),
            transfer_ms=(time.monotonic() - started) * 1000, error="" if ok else "past the deadline"))
