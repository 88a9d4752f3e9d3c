"""How a worker's ranks meet and talk: the store they meet at, each stage's TP group (its
all-reduces) and the point-to-point links between stages (activations forward, the rows
that need logits back to rank 0).

Every group is a process group of its own over one TCP store (``torch.distributed``'s,
served by rank 0): gloo on CPU, NCCL on CUDA. A link is a two-rank group per direction,
its sender rank 0 of it, so that on a GPU a send to the next stage never queues behind a
receive from the previous one on the same communicator. Groups are joined in one order on
every rank (TP groups by stage, then EP groups by stage, then the links forward, then the
link back), each rank only those it is in: a gloo group connects its members when made, and a common order
means no rank waits on a group whose other member waits on another.

    rank (s, t) --forward link--> rank (s + 1, t)          activations [2, rows, hidden]
    rank (P-1, 0) --link back--> rank 0                    hidden rows that need logits
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.layout import Layout

# One stage's compute between two messages is all a rank may wait for in a collective or a receive.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
READY_TIMEOUT = 600.0  # seconds for a helper to load its shard


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: rank r on the r-th GPU after the configured one; CPU: all on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def open_store(host: str, port: int, size: int, master: bool) -> dist.Store:
    """The group's meeting point: rank 0 serves it (``port`` 0: any free one), the others join."""
    return dist.TCPStore(host, port, size, is_master=master, wait_for_workers=False,
                         timeout=timedelta(seconds=READY_TIMEOUT))


def new_group(store: dist.Store, name: str, rank: int, size: int, device: torch.device, host: str):
    """A process group of ``size`` ranks under its own name in ``store``: NCCL on CUDA, else gloo."""
    store = dist.PrefixStore(name, store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, size)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


class Link:
    """One direction between two ranks: the sender sends, the receiver receives, tagged per
    message (its step's ``tag_base`` plus the micro-batch's index: ``engine.parallel.stage``).
    Both return the operation's handle; ``wait()`` it before the tensor is read (receive) or
    reused (send)."""

    def __init__(self, group):
        self.group = group

    def send(self, tensor: torch.Tensor, tag: int):
        return self.group.send([tensor], 1, tag)

    def recv(self, tensor: torch.Tensor, tag: int):
        return self.group.recv([tensor], 0, tag)


@dataclass
class RankGroups:
    """The groups one rank is in."""

    tp: object | None = None  # its stage's TP group (None at TP 1)
    ep: object | None = None  # its stage's EP group (None at EP 1; engine.parallel.experts)
    to_next: Link | None = None  # activations to the next stage
    from_prev: Link | None = None  # activations from the previous stage
    back: Link | None = None  # the returning rank: rows to rank 0; rank 0: rows from it


def join_groups(store: dist.Store, layout: Layout, rank: int, device: torch.device,
                host: str = "127.0.0.1") -> RankGroups:
    """Join every group ``rank`` is in, in the one order all ranks follow (see the module doc)."""
    out = RankGroups()
    place = layout.place(rank)
    if layout.tp > 1:
        for stage in range(layout.pp):
            if stage == place.stage and not place.experts_only:
                out.tp = new_group(store, f"tp{stage}", place.tp_rank, layout.tp, device, host)
    if layout.ep > 1:
        for stage in range(layout.pp):
            if stage == place.stage:
                out.ep = new_group(store, f"ep{stage}", place.ep_rank, layout.ep, device, host)
    if layout.pp == 1:
        return out
    for src in range(layout.size):
        dst = layout.next_rank(src)
        if dst is None:
            continue
        if rank in (src, dst):
            link = Link(new_group(store, f"fwd{src}-{dst}", 0 if rank == src else 1, 2, device, host))
            if rank == src:
                out.to_next = link
            else:
                out.from_prev = link
    src = layout.returning_rank
    if rank in (src, 0):
        out.back = Link(new_group(store, f"back{src}", 0 if rank == src else 1, 2, device, host))
    return out


def share_ids(group, input_ids: torch.Tensor) -> torch.Tensor:
    """A step's token ids from TP rank 0 to its stage's other ranks (their ``input_ids``, the
    same length, filled in place): the rows whose token an earlier step is still sampling have
    it on rank 0's device only (overlapped scheduling)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([input_ids], opts).wait()
    return input_ids
