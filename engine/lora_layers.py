"""The device side of multi-LoRA: slots, the per-step plan, and the batched LoRA matmul.

    LoraSlots   which adapter each of the ``max_loras`` device slots holds (plain Python):
                a step's adapters are placed in slots ``0..n-1``, least recently used out
    LoraTable   the slots' weights: per fused projection of each layer an ``A`` stack
                ``[S, in, k*R]`` (the k slices' A side by side, rank padded with zeros to R)
                and per slice a ``B`` stack ``[S, R, out_j]`` (the scale folded in)
    LoraBatch   one step's rows that run an adapter, sorted by slot (index tensors built
                once per step, read by every LoRA layer)
    LoraLinear  a projection plus its LoRA: ``y = W x`` then ``y[rows] += (x[rows] A_s) B_s``

One step mixes rows of several adapters and of the base model. Rows are grouped by slot and
each group runs its own adapter: when the groups are about the same size (decode) as two
batched matmuls over the slots at once (``bmm`` over ``[n, L, ...]``, groups padded to the
longest), otherwise (long prefills) one matmul pair per slot. Base-model rows never enter the
LoRA path, and a step without adapter rows skips it entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.config import ModelConfig
from engine.lora_adapter import LoraAdapter

# -- geometry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """A fused projection of one decoder layer that adapters can target."""

    group: str  # qkv | o | gate_up | down
    in_features: int
    out_features: tuple[int, ...]  # per slice, in the fused output's order

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.out_features[:j]) for j in range(len(self.out_features)))


def projections(cfg: ModelConfig, layer: int) -> dict[str, Projection]:
    """The projections of ``layer`` (a sparse MoE layer has no dense gate/up/down)."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    out = {"qkv": Projection("qkv", h, (q, kv, kv)), "o": Projection("o", q, (h,))}
    if not cfg.is_sparse(layer):
        inter = cfg.intermediate_size
        out |= {"gate_up": Projection("gate_up", h, (inter, inter)), "down": Projection("down", inter, (h,))}
    return out


# -- residency ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotCopy:
    """One change to the table: ``load`` an adapter into ``dst``, ``move`` slot ``src`` to
    ``dst`` (``dst``'s adapter is dropped), or ``swap`` the two slots."""

    kind: str
    dst: int
    src: int = -1
    adapter: LoraAdapter | None = None


class LoraSlots:
    """Which adapter each device slot holds. ``place`` puts a step's adapters in the front
    slots ``0..n-1`` (so the batched matmul reads ``A[:n]``, a view) and returns the copies
    that does; an adapter pushed out of the front keeps a slot further back unless it is the
    least recently used one."""

    def __init__(self, size: int):
        self.held: list[LoraAdapter | None] = [None] * size
        self.last_used = [0] * size
        self.clock = 0

    @property
    def size(self) -> int:
        return len(self.held)

    def slot_of(self, adapter: LoraAdapter) -> int | None:
        for i, held in enumerate(self.held):
            if held is adapter:
                return i
        return None

    def forget(self, adapter: LoraAdapter) -> None:
        """Free the slot of an adapter that will not run again (unloaded)."""
        slot = self.slot_of(adapter)
        if slot is not None:
            self.held[slot] = None
            self.last_used[slot] = 0

    def place(self, wanted: list[LoraAdapter]) -> list[SlotCopy]:
        """Bring the distinct adapters ``wanted`` into slots ``0..len(wanted)-1``."""
        n = len(wanted)
        if n > self.size:
            raise ValueError(f"{n} adapters in one step, but only {self.size} LoRA slots")
        want = {id(a) for a in wanted}
        free_front = [q for q in range(n) if self.held[q] is None or id(self.held[q]) not in want]
        copies: list[SlotCopy] = []
        behind = [a for a in wanted if (p := self.slot_of(a)) is not None and p >= n]
        absent = [a for a in wanted if self.slot_of(a) is None]
        for adapter in behind:  # resident further back: swap it to the front
            p, q = self.slot_of(adapter), free_front.pop()
            copies.append(SlotCopy("swap", q, p))
            self._exchange(p, q)
        for adapter in absent:
            q = free_front.pop()
            if self.held[q] is not None:
                keep = self._keep_slot(n, self.last_used[q])
                if keep is not None:
                    copies.append(SlotCopy("move", keep, q))
                    self.held[keep], self.last_used[keep] = self.held[q], self.last_used[q]
            copies.append(SlotCopy("load", q, adapter=adapter))
            self.held[q] = adapter
        self.clock += 1
        for q in range(n):
            self.last_used[q] = self.clock
        return copies

    def _exchange(self, p: int, q: int) -> None:
        self.held[p], self.held[q] = self.held[q], self.held[p]
        self.last_used[p], self.last_used[q] = self.last_used[q], self.last_used[p]

    def _keep_slot(self, n: int, used: int) -> int | None:
        """A slot behind the front for an adapter last used at ``used``: a free one, else the
        least recently used one if that is older; None: this adapter is the one to drop."""
        back = range(n, self.size)
        free = [r for r in back if self.held[r] is None]
        if free:
            return free[0]
        oldest = min(back, key=lambda r: self.last_used[r], default=None)
        return oldest if oldest is not None and self.last_used[oldest] < used else None


# -- weights --------------------------------------------------------------------------------


class TableEntry:
    """The slots' LoRA weights for one fused projection of one layer."""

    def __init__(self, proj: Projection, size: int, rank: int, device: torch.device, dtype: torch.dtype):
        self.proj = proj
        self.rank = rank
        k = len(proj.out_features)
        self.a = torch.zeros(size, proj.in_features, k * rank, device=device, dtype=dtype)
        self.b = [torch.zeros(size, rank, out, device=device, dtype=dtype) for out in proj.out_features]

    def write(self, slot: int, slices) -> None:
        """``slices``: the adapter's ``SliceWeights`` per slice (None: not targeted), or None."""
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        for j, sw in enumerate(slices or ()):
            if sw is not None:
                r = sw.a.shape[0]
                self.a[slot, :, j * self.rank : j * self.rank + r].copy_(sw.a.T)
                self.b[j][slot, :r].copy_(sw.b.T)

    def copy(self, src: int, dst: int) -> None:
        for t in (self.a, *self.b):
            t[dst].copy_(t[src])

    def swap(self, p: int, q: int) -> None:
        for t in (self.a, *self.b):
            held = t[p].clone()
            t[p].copy_(t[q])
            t[q].copy_(held)


class LoraTable:
    """Every layer's ``TableEntry``; executes the ``SlotCopy``s of ``LoraSlots.place``."""

    def __init__(self, cfg: ModelConfig, size: int, rank: int, device: torch.device, dtype: torch.dtype):
        self.entries = {(layer, group): TableEntry(proj, size, rank, device, dtype)
                        for layer in range(cfg.num_layers) for group, proj in projections(cfg, layer).items()}

    def apply(self, copies: list[SlotCopy]) -> None:
        for c in copies:
            for key, entry in self.entries.items():
                if c.kind == "load":
                    entry.write(c.dst, c.adapter.weights.get(key))
                elif c.kind == "move":
                    entry.copy(c.src, c.dst)
                else:
                    entry.swap(c.src, c.dst)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.entries.values() for t in (e.a, *e.b))


# -- one step -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapter rows, sorted by slot (slots ``0..num_slots-1`` all have rows)."""

    num_slots: int
    rows: torch.Tensor  # [V] token rows, by slot
    segments: list[tuple[int, int, int]]  # (slot, start, end) into ``rows``
    length: int  # the longest group: the batched form pads every group to it
    gather: torch.Tensor | None  # [num_slots * length] rows to read (pads repeat a row); None: per-slot form
    valid: torch.Tensor | None  # positions of the real rows in ``gather``; None: no padding
    identity: bool = False  # ``rows`` is every row in order (one adapter for the whole step): no gather/scatter

    @classmethod
    def plan(cls, query_lens: list[int], slots: list[int], device: torch.device) -> LoraBatch | None:
        """``slots[i]``: the slot of sequence i's adapter, -1 for the base model. None: no adapter rows."""
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), query_lens)
        idx = np.flatnonzero(per_row >= 0)
        if idx.size == 0:
            return None
        rows = idx[np.argsort(per_row[idx], kind="stable")]
        counts = np.bincount(per_row[rows])
        n, longest, total = len(counts), int(counts.max()), len(rows)
        ends = np.cumsum(counts)
        segments = [(s, int(e - c), int(e)) for s, (c, e) in enumerate(zip(counts, ends, strict=True))]
        gather = valid = None
        if n > 1 and n * longest <= 2 * total:  # groups of about one size: the batched form
            pos = np.arange(longest)
            starts = (ends - counts)[:, None]
            take = starts + np.minimum(pos[None, :], (counts - 1)[:, None])  # pad with each group's last row
            gather = torch.from_numpy(rows[take.reshape(-1)]).to(device)
            if n * longest != total:
                valid = torch.from_numpy((np.arange(n)[:, None] * longest + pos[None, :])[pos[None, :] < counts[:, None]]).to(device)
        identity = total == len(per_row) and n == 1
        return cls(n, torch.from_numpy(rows).to(device), segments, longest, gather, valid, identity)


def add_lora(y: torch.Tensor, x: torch.Tensor, entry: TableEntry, batch: LoraBatch) -> None:
    """``y[rows] += (x[rows] @ A_slot) @ B_slot`` for every adapter row, in place. The slices of
    a fused output are expanded one by one and joined, so ``y`` takes one whole-row
    ``index_add_`` (into a column slice it is an order of magnitude slower)."""
    R, k = entry.rank, len(entry.b)
    if batch.identity:
        h = x @ entry.a[0]
        y.add_(_join([h[:, j * R : (j + 1) * R] @ entry.b[j][0] for j in range(k)]))
        return
    if batch.gather is None:
        xs = x.index_select(0, batch.rows)
        parts = []
        for slot, start, end in batch.segments:
            h = xs[start:end] @ entry.a[slot]
            parts.append(_join([h[:, j * R : (j + 1) * R] @ entry.b[j][slot] for j in range(k)]))
        y.index_add_(0, batch.rows, _join(parts, dim=0))
        return
    n, length = batch.num_slots, batch.length
    h = torch.bmm(x.index_select(0, batch.gather).view(n, length, -1), entry.a[:n])
    d = _join([torch.bmm(h[:, :, j * R : (j + 1) * R], entry.b[j][:n]) for j in range(k)], dim=2)
    d = d.view(n * length, -1)
    if batch.valid is not None:
        d = d.index_select(0, batch.valid)
    y.index_add_(0, batch.rows, d)


def _join(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class LoraLinear(nn.Module):
    """A projection (``nn.Linear`` or a packed one) with the LoRA of whatever adapters the
    step's rows run; ``source.batch`` is the step's plan (None: no adapter rows)."""

    def __init__(self, base: nn.Module, entry: TableEntry, source):
        super().__init__()
        self.base = base
        self.entry = entry
        self.source = source  # the LoraManager: its ``batch`` is set once per step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.source.batch
        if batch is not None:
            add_lora(y, x, self.entry, batch)
        return y
