"""Where a nixl write goes when a pool is cut over ranks: each rank's part registered by its own
agent, and the descriptors of each (sending part, receiving part) pair.

A worker of several ranks (TP x PP) holds its KV pool as a grid of parts, a stage's layers by a
TP rank's heads (``kvstore.cache``); each part is ``[layers, planes, blocks, block_size, heads,
dim]`` in its own rank's memory, registered by that rank's agent. The receiver's params list its
parts (``parts``: agent, rev, region, layer and head ranges); the sender writes each overlap of
one of its parts with one of the receiver's, from the sending rank's agent straight into the
receiving rank's memory: the KV moves once, into the receiving layout.

    receiver params  + {"parts": [{"agent", "rev", "addr", "size", "layers": [lo, hi],
                                   "heads": [lo, hi]}, ...]}          (absent: one part, the flat fields)

Descriptors of one pair: a head range that is each side's whole part (equal TP, or the same
heads) is contiguous per (layer, plane, run of consecutive blocks), one descriptor each, as at
TP 1; otherwise the heads of one token row are the contiguous piece (heads are the second-last
dim), one descriptor per (layer, plane, block, token row): what SGLang does for prefill and
decode of different TP, and what re-sharding costs over a one-sided write.

Notifications: each pair is one NIXL transfer (one sending agent, one receiving agent) and ends
with its own notification, ``{key}#{i}/{n}``: pair ``i`` of the job's ``n``. The receiver's
rank 0 gathers them all (its helper ranks forward theirs) and the job has landed once all ``n``
came, whatever agent received each: no two pairs share a tag, so a receiver never waits for a
notification that was sent under another's name (SGLang's hang with prefill TP != decode TP). A
job of one pair keeps the plain key (TP 1 to TP 1, as always).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

MAX_PARTS = 64  # parts a receiver may list (ranks of one worker)
MAX_PAIRS = MAX_PARTS * MAX_PARTS  # notifications one job may end with
_PART = re.compile(rb"^(.*:\d+)#(\d+)/(\d+)$", re.S)


@dataclass(frozen=True)
class PartPlace:
    """One rank's part of a pool as registered: its agent, its region, its layers and heads."""

    agent: str
    rev: int
    addr: int
    size: int
    layers: tuple[int, int]
    heads: tuple[int, int]
    mem: str = "DRAM"
    device: int = 0

    def to_param(self) -> dict:
        return {"agent": self.agent, "rev": self.rev, "addr": self.addr, "size": self.size,
                "layers": list(self.layers), "heads": list(self.heads)}


@dataclass(frozen=True)
class Geometry:
    """What both sides agree on (checked from the params): the whole pool's layers and heads, and
    the shape of one token row's head."""

    num_layers: int
    num_heads: int
    planes: int
    block_size: int
    head_bytes: int  # head_dim x element size

    def part_block_bytes(self, place: PartPlace) -> int:
        return ((place.layers[1] - place.layers[0]) * self.planes * self.block_size
                * (place.heads[1] - place.heads[0]) * self.head_bytes)


def parts_of_params(params: dict, whole: PartPlace) -> list[PartPlace]:
    """The receiver's parts from its params: its ``parts`` list (checked flat and well formed), or
    the flat fields' one part (``whole``). ValueError for a malformed list."""
    given = params.get("parts")
    if given is None:
        return [whole]
    if not isinstance(given, list) or not 1 <= len(given) <= MAX_PARTS:
        raise ValueError(f"nixl params: parts must list 1 to {MAX_PARTS} parts")
    out = []
    for p in given:
        try:
            ints = [p[k] for k in ("rev", "addr", "size")]
            ranges = [p["layers"], p["heads"]]
            ok = (isinstance(p["agent"], str) and p["agent"] and all(type(v) is int and v >= 0 for v in ints)
                  and all(isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r)
                          and 0 <= r[0] < r[1] for r in ranges))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError("nixl params: a malformed part")
        out.append(PartPlace(p["agent"], p["rev"], p["addr"], p["size"], tuple(p["layers"]), tuple(p["heads"])))
    return out


def check_tiling(parts: list[PartPlace], geo: Geometry) -> None:
    """The parts cover every (layer, head) of the pool exactly once (ValueError otherwise)."""
    area = 0
    for i, a in enumerate(parts):
        if a.layers[1] > geo.num_layers or a.heads[1] > geo.num_heads:
            raise ValueError("nixl params: a part outside the pool's layers or heads")
        area += (a.layers[1] - a.layers[0]) * (a.heads[1] - a.heads[0])
        for b in parts[i + 1:]:
            if _overlap(a.layers, b.layers) and _overlap(a.heads, b.heads):
                raise ValueError("nixl params: two parts hold the same layers and heads")
    if area != geo.num_layers * geo.num_heads:
        raise ValueError("nixl params: the parts do not cover the pool")


@dataclass
class PairWrite:
    """One NIXL transfer of a job: sending part ``src`` (an index into the sender's parts) into
    receiving part ``dst``; ``local`` and ``remote`` are ``[n, 2]`` (addr, len) rows, pairwise."""

    src: int
    dst: int
    local: np.ndarray
    remote: np.ndarray


def plan_pairs(src: list[PartPlace], src_blocks: int, dst: list[PartPlace], dst_blocks: int, geo: Geometry,
               runs: list[tuple[int, int, int]]) -> list[PairWrite]:
    """Every pair of parts that share layers and heads, with its descriptors; ``runs``:
    (source block, destination block, count) runs of consecutive ids (``block_runs``);
    ``src_blocks``/``dst_blocks``: the block count of each side's pool."""
    out = []
    for i, s in enumerate(src):
        for j, d in enumerate(dst):
            layers, heads = _overlap(s.layers, d.layers), _overlap(s.heads, d.heads)
            if layers is None or heads is None:
                continue
            local = _pieces(s, src_blocks, geo, layers, heads, [(a, n) for a, _, n in runs], whole=heads == s.heads == d.heads)
            remote = _pieces(d, dst_blocks, geo, layers, heads, [(b, n) for _, b, n in runs], whole=heads == s.heads == d.heads)
            out.append(PairWrite(i, j, local, remote))
    return out


def _pieces(place: PartPlace, num_blocks: int, geo: Geometry, layers: tuple[int, int], heads: tuple[int, int],
            runs: list[tuple[int, int]], whole: bool) -> np.ndarray:
    """``[n, 2]`` (addr, len) of ``layers`` x ``heads`` of the runs' blocks in ``place``'s part:
    per (layer, plane, run) when ``whole`` (the heads are the part's all), else per (layer, plane,
    block, token row)."""
    row = (place.heads[1] - place.heads[0]) * geo.head_bytes
    block = geo.block_size * row
    plane = num_blocks * block
    layer = geo.planes * plane
    lp = (np.arange(layers[0] - place.layers[0], layers[1] - place.layers[0], dtype=np.int64)[:, None] * layer
          + np.arange(geo.planes, dtype=np.int64)[None, :] * plane).reshape(-1)  # (layer, plane) starts
    if whole:
        starts = np.asarray([b for b, _ in runs], dtype=np.int64) * block
        lens = np.asarray([n for _, n in runs], dtype=np.int64) * block
        addr = (lp[:, None] + starts[None, :]).reshape(-1)
        size = np.broadcast_to(lens, (len(lp), len(lens))).reshape(-1)
    else:
        blocks = np.concatenate([np.arange(b, b + n, dtype=np.int64) for b, n in runs])
        tokens = np.arange(geo.block_size, dtype=np.int64) * row
        addr = (lp[:, None, None] + blocks[None, :, None] * block + tokens[None, None, :]).reshape(-1)
        addr += (heads[0] - place.heads[0]) * geo.head_bytes
        size = np.full(len(addr), (heads[1] - heads[0]) * geo.head_bytes, dtype=np.int64)
    return np.stack([addr + place.addr, size], axis=1)


def inside(pieces: np.ndarray, addr: int, size: int) -> bool:
    """Every (addr, len) row of ``pieces`` lies in ``[addr, addr + size)``."""
    if not len(pieces):
        return True
    return bool(pieces[:, 0].min() >= addr and (pieces[:, 0] + pieces[:, 1]).max() <= addr + size
                and pieces[:, 1].min() >= 0)


def part_key(key: bytes, index: int, count: int) -> bytes:
    """Notification ``key`` of pair ``index`` of ``count`` (the plain key for a job of one pair)."""
    return key if count == 1 else key + f"#{index}/{count}".encode()


def split_part_key(key: bytes) -> tuple[bytes, int, int] | None:
    """(job key, pair index, pair count) of a pair's notification; None for a plain key."""
    m = _PART.match(key)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class PairNotifs:
    """The pairs' notifications of writes of several pairs (``part_key``), gathered on the
    receiver's rank 0 until each write's last: then the write's own key, as one notification of
    its writer (every pair must come from agents of one worker), with the payload one pair
    carried. At most ``kept`` writes are gathered at once (the oldest, long given up, go first)."""

    def __init__(self, kept: int = 4096):
        self.kept = kept
        self._open: dict[bytes, tuple[int, dict[int, str], list[bytes]]] = {}  # key -> (n, pair -> who, payload)

    def add(self, key: bytes, who: str, payload: bytes) -> tuple[bytes, str, bytes] | None:
        """A pair's notification came: the whole write's (key, writer, payload) once it was the
        last, else None. ValueError for one that does not fit its write."""
        job, index, count = split_part_key(key)
        if not 1 < count <= MAX_PAIRS or index >= count:
            raise ValueError(f"pair {index} of {count} is out of range")
        entry = self._open.get(job)
        if entry is None:
            entry = self._open[job] = (count, {}, [b""])
            while len(self._open) > self.kept:
                self._open.pop(next(iter(self._open)))
        n, seen, carried = entry
        if n != count:
            raise ValueError(f"pairs of one write say {n} and {count} pairs")
        if seen and _worker(who) != _worker(next(iter(seen.values()))):
            raise ValueError(f"pairs of one write from {_worker(who)!r} and another worker")
        seen[index] = who
        if payload:
            carried[0] = payload
        if len(seen) < n:
            return None
        del self._open[job]
        return job, who, carried[0]

    def forget(self, key: bytes) -> None:
        self._open.pop(key, None)

    def __len__(self) -> int:
        return len(self._open)


def _worker(agent: str) -> str:
    return agent.rpartition("-")[0]  # ``nixl_agent.agent_worker``: an agent's name is its worker's id and a suffix
