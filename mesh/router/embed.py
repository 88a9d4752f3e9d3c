"""The embed pool's router: which embed worker (role ``embed``) takes the next part of a request.

Embed workers keep no cache, so there is nothing to match: the least busy ready worker of the
model wins (requests this router has in flight on it), ties taken in turn. A worker that did not
answer is passed over for ``SUSPECT_FOR`` seconds unless it is the only one left. ``pick`` only
decides; the gateway sends (``gateway.embeddings``).
"""

from __future__ import annotations

import time

from mesh.protocol import WorkerCard
from mesh.registry import Membership

SUSPECT_FOR = 5.0


def pick_embed_worker(cards: list[WorkerCard], inflight: dict[str, int], turn: int) -> WorkerCard:
    """The card with the fewest requests in flight; among equals the ``turn``-th (round robin)."""
    if not cards:
        raise LookupError("no embed worker")
    least = min(inflight.get(c.worker_id, 0) for c in cards)
    idle = sorted((c for c in cards if inflight.get(c.worker_id, 0) == least), key=lambda c: c.worker_id)
    return idle[turn % len(idle)]


class EmbedRouter:
    def __init__(self, membership: Membership):
        self.membership = membership
        self.inflight: dict[str, int] = {}
        self._suspect: dict[str, float] = {}  # worker -> monotonic time it stops being suspect
        self._turn = 0

    def workers(self, model: str) -> list[WorkerCard]:
        """The model's ready embed workers."""
        return [c for c in self.membership.cards(model, "embed") if c.status == "ready"]

    def pick(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> WorkerCard:
        """LookupError when every ready worker is excluded (or there is none)."""
        cards = [c for c in self.workers(model) if c.worker_id not in exclude]
        now = time.monotonic()
        trusted = [c for c in cards if self._suspect.get(c.worker_id, 0.0) <= now]
        card = pick_embed_worker(trusted or cards, self.inflight, self._turn)
        self._turn += 1
        return card

    def started(self, worker_id: str) -> None:
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1

    def finished(self, worker_id: str) -> None:
        left = self.inflight.get(worker_id, 0) - 1
        if left > 0:
            self.inflight[worker_id] = left
        else:
            self.inflight.pop(worker_id, None)

    def suspect(self, worker_id: str) -> None:
        """It did not answer (gone, or draining): other workers first for a while."""
        now = time.monotonic()
        self._suspect = {w: t for w, t in self._suspect.items() if t > now}  # workers long gone drop out
        self._suspect[worker_id] = now + SUSPECT_FOR
