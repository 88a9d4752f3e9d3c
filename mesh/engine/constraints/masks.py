"""The token masks of one step: filled in a thread while the model runs, applied to the logits.

    engine thread                          mask thread
    -------------                          -----------
    begin_step(seqs) --submit-->           backend.fill(rows of constrained seqs) -> bitmask
    forward pass (model)                   ...
    sampler: StepMasks.apply(logits)  <--  wait for the fill, then one vectorised mask of every row

Matchers are only touched by the mask thread between ``begin_step`` and
``apply`` and by the engine thread after it (the scheduler advances them), so
no lock is needed. The bitmask buffer is reused every step: on CUDA the copy
to the device is done before the sampler reads its tokens back (a sync), so
the next step never overwrites bytes still in flight.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

FILL_TIMEOUT = 60.0  # seconds; a fill this slow is a broken grammar engine, and fails the step
_SHIFTS: dict[torch.device, torch.Tensor] = {}


class StepMasks:
    """The masks of the constrained rows of one step's sampled logits."""

    def __init__(self, done: Future, rows: list[int], bitmask: torch.Tensor, stats: Any = None):
        self._done = done
        self.rows = rows  # logits rows, in bitmask row order
        self.bitmask = bitmask  # [len(rows), words] int32, CPU
        self._stats = stats  # MaskStats: the time spent waiting is added to it

    def wait(self) -> None:
        """Block until the fill is done (it raises what the fill raised)."""
        t0 = time.perf_counter()
        self._done.result(timeout=FILL_TIMEOUT)
        if self._stats is not None:
            self._stats.wait_seconds += time.perf_counter() - t0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` with every disallowed token of the constrained rows at -inf (in place)."""
        self.wait()
        apply_bitmask(logits, self.bitmask, self.rows)
        return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask ``logits[rows[i]]`` by ``bitmask[i]``, all rows at once, on the logits' device."""
    vocab = logits.shape[1]
    allowed = _unpack(bitmask, vocab, logits.device)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.as_tensor(rows, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))


def _unpack(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Bits -> bool ``[rows, vocab]`` (bit ``t % 32`` of word ``t // 32`` is token ``t``)."""
    if device.type == "cpu":
        # numpy's unpackbits is one C loop; int32 words in little-endian memory are bytes in token order
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))  # 0/1 bytes are bools: no copy
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
