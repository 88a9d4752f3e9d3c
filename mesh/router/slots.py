"""Small integers for worker ids (``Slots``), and the slots set in a mask of them."""

from __future__ import annotations

import numpy as np


class Slots:
    """Small integers for worker ids: a worker's bit in the index's holder masks (and its row in the
    router's load arrays). A router shares one among its indexes and its load table; a slot is
    given back only when its worker has left all of them."""

    def __init__(self):
        self.of: dict[str, int] = {}
        self.ids: list[str | None] = []  # slot -> worker
        self.bits: list[int] = []  # slot -> 1 << slot, one int object shared by every mask of one holder
        self._free: list[int] = []

    def slot(self, worker: str) -> int:
        """The worker's slot, given one if it has none."""
        s = self.of.get(worker)
        if s is None:
            if self._free:
                s = self._free.pop()
                self.ids[s] = worker
            else:
                s = len(self.ids)
                self.ids.append(worker)
                self.bits.append(1 << s)
            self.of[worker] = s
        return s

    def get(self, worker: str) -> int | None:
        return self.of.get(worker)

    def release(self, worker: str) -> None:
        s = self.of.pop(worker, None)
        if s is not None:
            self.ids[s] = None
            self._free.append(s)

    def __len__(self) -> int:
        return len(self.ids)


def slots_in(mask: int) -> list[int]:
    """The slots set in ``mask``, ascending."""
    if not mask & (mask - 1):
        return [mask.bit_length() - 1] if mask else []  # one holder: the usual case
    return slot_array(mask).tolist()


def slot_array(mask: int) -> np.ndarray:
    """``slots_in`` as an array (no Python int per slot: a mask of 1,000 holders is one C pass)."""
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))
