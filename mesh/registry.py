"""The worker registry: cards in a JetStream KV bucket, with a TTL.

A worker puts its card when it starts and refreshes it every ``ttl / 3``; on a
clean exit it deletes it. The bucket's max age drops cards nobody refreshes,
and every watcher also expires them locally (a KV watch is not told when a
value ages out), so a killed worker leaves everyone's view within the TTL.

A card's key is ``{role}.{worker id}`` (both as subject tokens), so that a
watcher that needs one role watches only its keys: a decode worker follows the
prefill pool, not every decode worker's refreshes (at N decode workers each
refreshing every 2 s, watching all of them cost the bus N x N / 2 deliveries a
second). Gateways, routers and planners watch every key.

A view reads the bucket's cards once through a KV watch (an ordered consumer: every live card,
then a marker), then stops it and follows the puts and deletes with a plain subscription on the
bucket's subjects (``$KV.{bucket}.>``): at 1,000 workers refreshes come 500 a second, and through
the watch each cost the reader ~100 us (two queues, the ack subject's metadata parsed, an entry
built) against ~30 on a plain subscription. Both carry the same message; what the plain one can
miss (a disconnect) the watch's replay after a reconnect, or the card's TTL, makes good (a replay
that overlaps a put may hand back the card before it for one refresh period). A refresh (the same
bytes but ``updated``) is not decoded: the held card takes the new time.

The workers of one process keep their cards together under a few set keys (``mesh.cardset``:
``{role}.set.{process}-{n}``, a ``HostCards`` each): a view holds each card in it as if it had its
own key, and drops a worker only when the key it last came under stops naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from functools import partial

import msgspec
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from mesh.bus import Bus
from mesh.procutil import cancel_and_wait, until_tick
from mesh.protocol import DecodeError, HostCards, WorkerCard, decode, encode, subject_token

log = logging.getLogger(__name__)

DEFAULT_TTL = 6.0


def js_replicas(bus: Bus) -> int:
    """Replicas of the JetStream streams and buckets this process creates (``--js-replicas``)."""
    return getattr(bus, "js_replicas", 1)


async def open_bucket(bus: Bus, ttl: float = DEFAULT_TTL) -> KeyValue:
    name = bus.subjects.workers_bucket()
    try:
        return await bus.js.key_value(name)
    except BucketNotFoundError:
        pass
    try:
        return await bus.js.create_key_value(bucket=name, ttl=ttl, history=1, replicas=js_replicas(bus))
    except Exception:
        # Another process created it between our two calls.
        return await bus.js.key_value(name)


def card_key(card: WorkerCard) -> str:
    """The card's key in the registry bucket: ``{role}.{worker id}``."""
    return f"{subject_token(card.role)}.{subject_token(card.worker_id)}"


def set_key(role: str, process: str, part: int) -> str:
    """The key of part ``part`` of a process's cards of ``role`` (``mesh.cardset``): three tokens, where a
    worker's own key has two."""
    return f"{subject_token(role)}.set.{subject_token(process)}-{part}"


def _is_set_key(key: str) -> bool:
    return key.count(".") == 2 and key.split(".", 2)[1] == "set"


_UPDATED = b"\xa7updated\xcb"  # msgpack: the key "updated", then a float64's marker (its 8 bytes follow)


def _refreshed(held: bytes, value: bytes) -> float | None:
    """``value``'s ``updated`` when it is the card ``held`` with only that field changed (a refresh),
    else None. msgspec writes a float as a float64 always, so a refresh is the same length."""
    if len(value) != len(held):
        return None
    at = value.find(_UPDATED) + len(_UPDATED)
    if at < len(_UPDATED) or value[:at] != held[:at] or value[at + 8:] != held[at + 8:]:
        return None
    return _FLOAT64.unpack_from(value, at)[0]


_FLOAT64 = struct.Struct(">d")


async def refresh_forever(ttl: float, put: Callable[[], Awaitable[None]], reopen: Callable[[], Awaitable[None]],
                          what: str) -> None:
    """``put()`` every ``ttl / 3``, on the process's tick (``until_tick``: with its other cards);
    a failed put (reconnecting, or the server lost the bucket) reopens the bucket for the next."""
    while True:
        await asyncio.sleep(until_tick(ttl / 3))
        try:
            await put()
        except Exception as e:
            log.warning("registry refresh of %s failed: %s", what, e)
            with contextlib.suppress(Exception):
                await reopen()


class CardPublisher:
    """Keeps one worker's card in the registry while the worker lives (the workers of one process
    keep theirs together instead: ``mesh.cardset``)."""

    def __init__(self, bus: Bus, card_fn: Callable[[], WorkerCard], ttl: float = DEFAULT_TTL):
        self.bus = bus
        self.card_fn = card_fn
        self.ttl = ttl
        self._kv: KeyValue | None = None
        self._task: asyncio.Task | None = None
        self._key = ""
        self._put_at = time.monotonic()  # when the last put that succeeded began (its card's ``updated``)

    async def start(self) -> None:
        self._kv = await open_bucket(self.bus, self.ttl)
        await self.put()
        self._task = asyncio.create_task(refresh_forever(self.ttl, self.put, self._reopen, self._key),
                                         name="registry-refresh")

    async def _reopen(self) -> None:
        self._kv = await open_bucket(self.bus, self.ttl)

    async def put(self) -> None:
        card = self.card_fn()
        began, card.updated = time.monotonic(), time.time()
        self._key = card_key(card)
        await asyncio.wait_for(self._kv.put(self._key, encode(card)), 5.0)
        self._put_at = began

    def age(self) -> float:
        """Seconds since the newest card that reached the registry was made: a watcher counts this
        worker gone once that is its TTL (a partition, or a registry it cannot reach)."""
        return time.monotonic() - self._put_at

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait([self._task])
        if self._kv and self._key:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv.delete(self._key), 2.0)


class Membership:
    """A live view of the registry: cards by worker id, stale ones expired locally. ``role``: only
    the cards of workers of this role (a decode worker's view of the prefill pool)."""

    def __init__(self, bus: Bus, ttl: float = DEFAULT_TTL, role: str | None = None):
        self.bus = bus
        self.ttl = ttl
        self.role = role
        self._cards: dict[str, WorkerCard] = {}
        self._seen: dict[str, float] = {}  # monotonic time of the card's last refresh
        self._listeners: list[Callable[[str, WorkerCard | None], None]] = []
        self._tasks: list[asyncio.Task] = []
        self._watcher = None
        self._watch_task: asyncio.Task | None = None
        self._follow = None  # the plain subscription on the bucket's subjects (after the first replay)
        self._raw: dict[str, tuple] = {}  # key -> (worker id, or a set key's ids; its bytes as last read)
        self._owner: dict[str, str] = {}  # worker id -> the key its card last came under
        self._rewatching = False  # the watch is being re-opened: no news is not bad news
        self._models_seen: dict[str, float] = {}  # model -> monotonic time a card of it was last seen
        self._last_entry = time.monotonic()  # of the last fresh card the watch delivered
        self._hold_until = 0.0  # monotonic: no card expires before (the watch was just re-opened)
        self._stall_task: asyncio.Task | None = None
        self._freshest = float("inf")  # the age of the freshest card read since the last sweep
        self.ready = asyncio.Event()
        # bumped by every join, leave or change of a card (not a refresh): views derived from
        # the cards (``cards_of``) are rebuilt only when it moves
        self.version = 0
        self._derived: dict[tuple, object] = {}
        self._derived_version = 0

    def on_change(self, fn: Callable[[str, WorkerCard | None], None]) -> None:
        """``fn(worker_id, card)`` when a worker joins or its card changes; ``card`` is None when it
        leaves. A refresh that only moves ``updated`` notifies nobody: at 1,000 workers refreshes
        come 500 a second, and each listener would run for every one."""
        self._listeners.append(fn)

    def off_change(self, fn: Callable[[str, WorkerCard | None], None]) -> None:
        """Stop calling ``fn`` (a worker that shares this view with others in its process leaves)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    async def start(self, wait: float = 5.0) -> None:
        await self._open_watch()
        self._tasks.append(asyncio.create_task(self._sweep(), name="registry-sweep"))
        self.bus.on_reconnect(self._rewatch)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), wait)

    async def _open_watch(self) -> None:
        kv = await open_bucket(self.bus, self.ttl)
        if self._follow is None:  # first, so that no put falls between the replay and it
            keys = f"{subject_token(self.role)}.>" if self.role else ">"
            prefix = f"$KV.{self.bus.subjects.workers_bucket()}."
            self._follow = await self.bus.nc.subscribe(prefix + keys, cb=partial(self._on_put, len(prefix)),
                                                       pending_msgs_limit=1 << 20)
        self._watcher = await (kv.watch(f"{subject_token(self.role)}.>") if self.role else kv.watchall())
        self._watch_task = asyncio.create_task(self._watch(self._watcher), name="registry-watch")
        self._tasks.append(self._watch_task)

    async def _rewatch(self) -> None:
        """After a reconnect the server may have dropped the watch's consumer: start a new one.
        It replays every live card, so nothing is missed; stale ones still expire by TTL. While
        it is re-opened (a NATS cluster electing a new JetStream leader takes seconds) cards do
        not expire: not hearing from the registry says nothing about the workers."""
        old, task = self._watcher, getattr(self, "_watch_task", None)
        self._rewatching = True
        try:
            for attempt in range(10):
                try:
                    await self._open_watch()
                    break
                except Exception as e:
                    log.info("registry watch not back yet (%s)", e)
                    await asyncio.sleep(0.5 * (attempt + 1))
        finally:
            self._rewatching = False
            # the workers get one refresh period to be heard on the new watch before any expires
            self._hold_until = time.monotonic() + self.ttl / 2
        if task is not None:
            task.cancel()
            if task in self._tasks:
                self._tasks.remove(task)
        if old is not None:
            with contextlib.suppress(Exception):
                await old.stop()

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self._follow is not None:
            with contextlib.suppress(Exception):
                await self._follow.unsubscribe()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    def cards(self, model: str | None = None, role: str | None = None) -> list[WorkerCard]:
        return [
            c for c in self._cards.values()
            if (model is None or c.model == model) and (role is None or c.role == role)
        ]

    def cards_of(self, model: str | None = None, role: str | None = None) -> list[WorkerCard]:
        """``cards(model, role)`` kept until the membership changes: what a per-request path reads
        (at 1,000 workers, filtering every card per request was its cost). A card in it may be an
        earlier refresh of the worker's (only its ``updated`` differs). Do not change the list."""
        return self.derived(("cards", model, role), lambda: self.cards(model, role))

    def derived(self, key: tuple, build: Callable[[], object]):
        """``build()``, kept under ``key`` until the membership changes (a join, a leave, a card that
        changed: not a refresh). Callers only read what it returns."""
        if self._derived_version != self.version or len(self._derived) > 256:
            self._derived.clear()
            self._derived_version = self.version
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = build()
        return got

    def get(self, worker_id: str) -> WorkerCard | None:
        return self._cards.get(worker_id)

    def vouches(self, worker_id: str, role: str, model: str) -> bool:
        """A worker of this id, role and model is in the registry: what a load report or KV event
        batch claims about its sender is believed only then (anyone on the bus may claim an id;
        a worker's first reports before its card arrives are dropped, its next ones count)."""
        card = self._cards.get(worker_id)
        return card is not None and card.role == role and card.model == model

    def models(self) -> list[str]:
        return sorted({c.model for c in self._cards.values()})

    def served_recently(self, model: str, within: float = 600.0) -> bool:
        """A card of ``model`` was seen in the last ``within`` seconds (its workers may be back soon:
        a request for it is a 503, not a 404)."""
        seen = self._models_seen.get(model)
        return seen is not None and time.monotonic() - seen < within

    async def _watch(self, watcher) -> None:
        """The replay: every live card, then the marker; then the watch stops (``_on_put`` follows)."""
        async for entry in watcher:
            if entry is None:  # the initial values are all in
                self.ready.set()
                break
            self._entry(entry.key, entry.value if entry.operation not in ("DEL", "PURGE") else b"")
        with contextlib.suppress(Exception):
            await watcher.stop()

    async def _on_put(self, skip: int, msg) -> None:
        """A put or a delete (empty, with a ``KV-Operation`` header) on the bucket's subjects."""
        self._entry(msg.subject[skip:], msg.data)

    def _entry(self, key: str, value: bytes) -> None:
        if not value:
            self._drop_key(key)
            return
        if _is_set_key(key):
            self._entry_set(key, value)
            return
        held = self._raw.get(key)
        updated = None if held is None or held[0] not in self._cards else _refreshed(held[1], value)
        if updated is not None:  # a refresh: the card as held, newer (not decoded: 500 a second at 1,000 workers)
            card = old = self._cards[held[0]]
            card.updated = updated
        else:
            try:
                card = decode(value, WorkerCard)
            except DecodeError as e:
                log.warning("ignoring a malformed card %s: %s", key, e)
                return
            if self.role is not None and card.role != self.role:
                return  # a card under a key that is not its role's
            old = self._cards.get(card.worker_id)
        if self._keep(card, old, key):
            self._raw[key] = (card.worker_id, value)

    def _entry_set(self, key: str, value: bytes) -> None:
        """A process's set key (``mesh.cardset``): its workers' cards, all as new as the set."""
        held = self._raw.get(key)
        updated = None if held is None else _refreshed(held[1], value)
        if updated is not None and all(w in self._cards for w in held[0]):
            for w in held[0]:  # a refresh: the cards as held, newer (not decoded)
                card = self._cards[w]
                card.updated = updated
                self._keep(card, card, key)
            self._raw[key] = (held[0], value)
            return
        try:
            got = decode(value, HostCards)
            cards = [decode(raw, WorkerCard) for raw in got.cards]
        except DecodeError as e:
            log.warning("ignoring a malformed card set %s: %s", key, e)
            return
        kept = []
        for card in cards:
            if self.role is None or card.role == self.role:
                card.updated = got.updated
                if self._keep(card, self._cards.get(card.worker_id), key):
                    kept.append(card.worker_id)
        for w in held[0] if held is not None else ():
            if w not in kept and self._owner.get(w) == key:
                self._drop(w)  # stopped, or gone from a replay as too old
        self._raw[key] = (tuple(kept), value)

    def _keep(self, card: WorkerCard, old: WorkerCard | None, key: str) -> bool:
        """Hold ``card`` (``key``'s), unless it is a dead worker's last (a replay); tell the listeners
        when it joins or changes."""
        age = min(max(time.time() - card.updated, 0.0), self.ttl)
        self._seen[card.worker_id] = time.monotonic() - age
        if age >= self.ttl:
            return False  # a dead worker's last card (a replay): says nothing about our lag
        self._freshest = min(self._freshest, age)
        self._cards[card.worker_id] = card
        self._owner[card.worker_id] = key
        now = time.monotonic()
        self._last_entry = now
        self._models_seen[card.model] = now
        if old is None or (old is not card and msgspec.structs.replace(old, updated=card.updated) != card):
            self.version += 1
            self._notify(card.worker_id, card)
        self.ready.set()
        return True

    def _drop_key(self, key: str) -> None:
        held = self._raw.pop(key, None)
        if _is_set_key(key):
            for w in held[0] if held is not None else ():
                if self._owner.get(w) == key:
                    self._drop(w)
            return
        token = key.rsplit(".", 1)[-1]  # {role}.{worker id}, or a bare worker id (an older writer's)
        for wid in [w for w in self._cards if subject_token(w) == token]:
            self._drop(wid)

    def _drop(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
        self._owner.pop(worker_id, None)
        if self._cards.pop(worker_id, None) is not None:
            self.version += 1
            self._notify(worker_id, None)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.ttl / 4))
            now = time.monotonic()
            behind = self.ttl / 3 < self._freshest < float("inf")  # none read: _check_stall's to judge
            self._freshest = float("inf")
            if behind:
                # Even the freshest card read since the last sweep was older than a refresh period:
                # this process reads the registry late (its loop is busy), and the newer cards wait
                # in its queue. Its lag is not the workers' silence: none expires until it catches up.
                log.info("reading the registry late: no card expires until it catches up")
            if self._rewatching or now < self._hold_until or behind:
                # the replay after the watch is back refreshes every live card: count from then
                self._seen = {w: max(t, now - self.ttl / 2) for w, t in self._seen.items()}
                continue
            for wid, t in [(w, t) for w, t in self._seen.items() if now - t > self.ttl]:
                self._seen.pop(wid, None)
                if wid in self._cards:
                    log.info("worker %s expired from the registry (its newest card is %.1f s old)", wid, now - t)
                    self._drop(wid)
            self._check_stall(now)

    def _check_stall(self, now: float) -> None:
        """Every live worker refreshes its card each ``ttl / 3``: when none has been heard for
        ``ttl / 2``, the registry is what stalled (its stream's leader lost with a host, a cluster
        electing another), not every worker at once. The watch is re-opened, and no card expires
        until it is back; its replay then says which workers really are gone."""
        if not self._cards or now - self._last_entry <= self.ttl / 2:
            return
        if self._stall_task is not None and not self._stall_task.done():
            return
        self._rewatching = True
        self._stall_task = asyncio.create_task(self._recover(now - self._last_entry), name="registry-rewatch")
        self._last_entry = now  # one check per stall
        self._tasks.append(self._stall_task)

    async def _recover(self, silent_s: float) -> None:
        """A view of one role (a decode worker's of the prefill pool) may hear nothing because
        every worker of that role is gone, not the registry: if the bucket answers, the silence
        is theirs and they expire as usual. Otherwise the watch is re-opened (``_rewatch``)."""
        if self.role is not None:
            try:
                kv = await asyncio.wait_for(open_bucket(self.bus, self.ttl), 2.0)
                await asyncio.wait_for(kv.status(), 2.0)
                self._rewatching = False
                return
            except Exception as e:
                log.info("the registry does not answer (%s)", e)
        log.info("no card refreshed for %.1fs: re-opening the registry watch", silent_s)
        await self._rewatch()

    def _notify(self, worker_id: str, card: WorkerCard | None) -> None:
        for fn in self._listeners:
            try:
                fn(worker_id, card)
            except Exception:
                log.exception("membership listener failed")
