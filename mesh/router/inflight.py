"""What a router has sent to each worker that the worker's load reports may not show yet."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Inflight:
    """A routed request its worker's load reports may not show yet."""

    timestamp: float
    prompt_blocks: int
    new_blocks: int  # still to prefill; 0 once the first token is out


class _InflightQueue:
    """One worker's routed requests, oldest first, and their sums: a route reads a worker's load
    without walking its requests (at C=128 that walk was a quarter of a route's time)."""

    __slots__ = ("items", "new_blocks", "prompt_blocks")

    def __init__(self):
        self.items: OrderedDict[str, _Inflight] = OrderedDict()
        self.prompt_blocks = 0
        self.new_blocks = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, request_id: str, d: _Inflight) -> None:
        old = self.items.get(request_id)
        if old is not None:
            self._less(old)
        self.items[request_id] = d
        self.prompt_blocks += d.prompt_blocks
        self.new_blocks += d.new_blocks

    def get(self, request_id: str) -> _Inflight | None:
        return self.items.get(request_id)

    def pop(self, request_id: str) -> None:
        d = self.items.pop(request_id, None)
        if d is not None:
            self._less(d)

    def prefilled(self, request_id: str) -> None:
        d = self.items.get(request_id)
        if d is not None:
            self.new_blocks -= d.new_blocks
            d.new_blocks = 0

    def drop_before(self, timestamp: float) -> None:
        """Forget the oldest ones, up to the first at or after ``timestamp``."""
        items = self.items
        while items and next(iter(items.values())).timestamp < timestamp:
            self._less(items.popitem(last=False)[1])

    def _less(self, d: _Inflight) -> None:
        self.prompt_blocks -= d.prompt_blocks
        self.new_blocks -= d.new_blocks
