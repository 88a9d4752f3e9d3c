"""A process's workers in the registry together: a few set keys refreshed as one, not a key each.

Each worker alone keeps its own card (``mesh.registry.CardPublisher``, key ``{role}.{worker id}``)
and refreshes it every ``ttl / 3``: at 1,000 workers, 500 JetStream puts a second, each answered
to its worker and delivered to every gateway, router and planner. The workers of one process
(``worker.host``: ``mesh worker mock --num-workers N``, as on one host) live and die together, so
the process keeps their cards as ``HostCards`` under a few keys, ``{role}.set.{process}-{n}``, each
holding up to ``MAX_CARDS`` of them (and ``MAX_PART_BYTES``), and refreshes those: 1,000 workers in
8 processes are 8 x 2 puts every 2 s. A refresh changes only the set's ``updated`` (every card's
time in it), so a view takes it without decoding a card. A process that dies stops refreshing,
and every watcher expires its workers together, within the TTL, as a dead host's.

A worker keeps its part while it fits: a worker moving between parts would, between the two puts,
look gone. When a card outgrows its part, the part it moves to is put first; a view drops a worker
only when the key it last came under stops naming it (``Membership``). A worker that stops is taken
out of its part (a leave for every view); the last one out deletes the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from nats.js.kv import KeyValue

from mesh.bus import Bus
from mesh.procutil import cancel_and_wait
from mesh.protocol import HostCards, WorkerCard, encode, subject_token
from mesh.registry import DEFAULT_TTL, open_bucket, refresh_forever, set_key

log = logging.getLogger(__name__)

MAX_CARDS = 64  # cards in one set key
MAX_PART_BYTES = 256 << 10  # their bytes (a put is one NATS message: 1 MiB by default)


class CardSet:
    """The cards of one process's workers, in the registry under its set keys while they live."""

    def __init__(self, bus: Bus, process: str, ttl: float = DEFAULT_TTL, max_cards: int = MAX_CARDS):
        self.bus = bus
        self.process = subject_token(process)
        self.ttl = ttl
        self.max_cards = max_cards
        self.puts = 0  # set keys put (each a JetStream put)
        self._members: dict[str, Callable[[], WorkerCard]] = {}  # worker id -> its card
        self._part_of: dict[str, tuple[str, int]] = {}  # worker id -> (role, part)
        self._written: dict[str, set[str]] = {}  # key -> the workers last put under it
        self._kv: KeyValue | None = None
        self._task: asyncio.Task | None = None
        self._pending: asyncio.Task | None = None  # the put that callers of this turn share
        self._lock = asyncio.Lock()
        self._put_at = time.monotonic()

    async def start(self) -> None:
        self._kv = await open_bucket(self.bus, self.ttl)
        self._task = asyncio.create_task(refresh_forever(self.ttl, self.put, self._reopen, self.process),
                                         name="registry-refresh")

    async def _reopen(self) -> None:
        self._kv = await open_bucket(self.bus, self.ttl)

    def member(self, card_fn: Callable[[], WorkerCard]) -> Member:
        """A worker's handle on its card here: what ``CardPublisher`` is to a worker alone."""
        return Member(self, card_fn)

    async def add(self, card_fn: Callable[[], WorkerCard]) -> str:
        """Keep this worker's card (``card_fn()``, read at every put) from now on; returns its id
        once a put with it has reached the registry."""
        worker_id = card_fn().worker_id
        self._members[worker_id] = card_fn
        try:
            await self.put()
        except BaseException:
            self._members.pop(worker_id, None)  # its start fails (or is retried): not kept meanwhile
            raise
        return worker_id

    async def remove(self, worker_id: str) -> None:
        """Take a worker out (it stops): its part is put without it, or deleted when empty."""
        if self._members.pop(worker_id, None) is not None:
            await self.put()

    async def put(self) -> None:
        """Put every part now (a card changed: draining, adapters). Callers in one turn of the loop
        share one put, which reads the cards after they all called."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._put_all())
        await asyncio.shield(self._pending)

    def age(self) -> float:
        """Seconds since the newest put that reached the registry began (``CardPublisher.age``)."""
        return time.monotonic() - self._put_at

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        self._members.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._put_all(), 2.0)

    async def _put_all(self) -> None:
        self._pending = None  # a call from now on needs a put that reads the cards after it
        async with self._lock:
            began, now = time.monotonic(), time.time()
            parts = {set_key(role, self.process, n): cards for (role, n), cards in self._pack().items()}
            ids = {key: {w for w, _ in cards} for key, cards in parts.items()}
            gaining = [k for k in parts if not ids[k] <= self._written.get(k, set())]
            for key in gaining + [k for k in parts if k not in gaining]:
                value = encode(HostCards(now, [raw for _, raw in parts[key]]))
                await asyncio.wait_for(self._kv.put(key, value), 5.0)
                self._written[key] = ids[key]
                self.puts += 1
            for key in [k for k in self._written if k not in parts]:
                await asyncio.wait_for(self._kv.delete(key), 5.0)
                del self._written[key]
            self._put_at = began

    def _pack(self) -> dict[tuple[str, int], list[tuple[str, bytes]]]:
        """(role, part) -> its workers' encoded cards: each worker in its part while it fits, new
        ones (and those that outgrew theirs) in the first part with room."""
        cards = {}
        for worker_id, card_fn in self._members.items():
            card = card_fn()
            cards[worker_id] = (card.role, encode(msgspec.structs.replace(card, updated=0.0)))
        parts: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
        size: dict[tuple[str, int], int] = {}

        def fits(part: tuple[str, int], raw: bytes) -> bool:
            return len(parts.get(part, ())) < self.max_cards and size.get(part, 0) + len(raw) <= MAX_PART_BYTES

        def place(part: tuple[str, int], worker_id: str, raw: bytes) -> None:
            parts.setdefault(part, []).append((worker_id, raw))
            size[part] = size.get(part, 0) + len(raw)
            self._part_of[worker_id] = part

        homeless = []
        for worker_id, (role, raw) in cards.items():
            part = self._part_of.get(worker_id)
            if part is not None and part[0] == role and fits(part, raw):
                place(part, worker_id, raw)
            else:
                homeless.append((worker_id, role, raw))
        for worker_id, role, raw in homeless:
            n = 0
            while not fits((role, n), raw) and parts.get((role, n)):
                n += 1  # a card alone in a part fits whatever its size (it is bounded on its own)
            place((role, n), worker_id, raw)
        for worker_id in [w for w in self._part_of if w not in cards]:
            del self._part_of[worker_id]
        return parts


class Member:
    """One worker's card in its process's ``CardSet``, with ``CardPublisher``'s calls: ``start``
    (in from the next put, which it waits for), ``put`` (its card changed: every part put now),
    ``age`` (the set's last put) and ``stop`` (out: a leave for every view)."""

    def __init__(self, cards: CardSet, card_fn: Callable[[], WorkerCard]):
        self.cards = cards
        self.card_fn = card_fn
        self.worker_id = ""  # once in

    async def start(self) -> None:
        self.worker_id = await self.cards.add(self.card_fn)

    async def put(self) -> None:
        await self.cards.put()

    def age(self) -> float:
        return self.cards.age()

    async def stop(self) -> None:
        if self.worker_id:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.cards.remove(self.worker_id), 2.0)
