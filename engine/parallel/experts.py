"""Expert parallelism: each rank of a stage's EP group holds ``1/ep`` of every MoE layer's routed
experts; a token's (token, expert) pairs go to the ranks that hold its experts, and the experts'
outputs come back to be combined where the token is.

Which ranks hold what (``Layout``): the EP group is the stage's TP group and, where ``ep`` >
``tp``, ranks past it that hold experts only (no attention, no KV, no router;
``engine.parallel.expert_rank``). Attention is neither replicated nor data-parallel: it stays
tensor-parallel on the TP group, as without EP, so the KV and every path that moves it are
unchanged. After attention every TP rank holds all ``T`` tokens; each dispatches its own slice
(``token_slice``: rank ``t`` of ``tp`` the rows ``[t*T/tp, (t+1)*T/tp)``), runs the router and the
shared experts (replicated: whole on every TP rank) on that slice only, and the slices meet
again in the all-reduce the layer ends with under TP anyway:

    TP rank t:  route slice t --dispatch--> EP ranks: their experts on the rows they got
                combine (weights, in expert order) <--return--/
                + shared experts(slice t) --> all-reduce over the TP group (TP 1: none)

How the pairs travel is a ``TokenDispatch`` from ``DISPATCH`` (one per rank, shared by its MoE
layers): ``alltoall``, the default, first exchanges every rank's per-expert counts (each rank
sends its whole histogram to every rank: the split sizes, and the global per-expert load for
``pdmesh_moe_expert_tokens`` at no extra cost), then the rows, then the experts' outputs back,
each an ``alltoall_base`` (gloo on CPU, NCCL on CUDA). A rank that holds experts only sends no
rows; it serves exchanges until the forward's end marker (``end_forward``) and so never needs
to know which layers or steps a forward runs.

The combine is the grouped experts' own (``engine.moe.GroupedExperts``): the returned rows,
sorted by expert, times their weights, added onto their tokens in expert order; each expert sees
its rows in token order. So EP changes no arithmetic: ``--ep 2`` computes what ``--ep 1`` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

END_OF_FORWARD = -1  # a counts header: the forward is over (a rank that holds experts only returns)
LISTENING = -2  # a counts header: this rank has no tokens (it holds experts only)


@dataclass
class ExpertShard:
    """Which routed experts this rank holds and how its tokens reach the others' (``Shard.experts``)."""

    rank: int  # in the stage's EP group
    size: int  # ranks in it (``--ep``)
    token_ranks: int  # the ranks that hold tokens (the TP group) and dispatch a slice each
    token_rank: int | None  # this rank's place among them; None: it holds experts only
    dispatch_name: str = "alltoall"
    dispatch: TokenDispatch | None = field(default=None, repr=False)  # once the EP group is joined

    def local(self, num_experts: int) -> range:
        """The experts this rank holds: a contiguous ``1/size`` of them."""
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def token_slice(self, n: int) -> slice:
        """The rows of an ``n``-token batch this rank routes and dispatches."""
        t, k = self.token_rank, self.token_ranks
        return slice(t * n // k, (t + 1) * n // k)

    def connect(self, group) -> None:
        """The EP group is joined: make this rank's dispatch over it."""
        self.dispatch = create_dispatch(self.dispatch_name, group, self.rank, self.size, self.token_ranks)

    def forward(self, moe, x: torch.Tensor) -> torch.Tensor:
        """``moe`` (a ``SparseMoE`` holding this rank's experts) over the ``[T, H]`` batch every TP
        rank holds: this rank's slice routed and dispatched, its shared experts, the slices summed
        over the TP group."""
        rows = self.token_slice(len(x))
        xs = x[rows]
        ids, weights = moe.route(xs)
        out, load = self.dispatch.route(moe.layer, xs, ids, weights, moe.experts, moe.num_experts)
        moe.expert_tokens.add_(load.to(moe.expert_tokens.device))
        if moe.shared_expert is not None:
            out = out + moe.shared_expert(xs)
        if self.token_ranks == 1:
            return out
        whole = x.new_zeros(x.shape)
        whole[rows] = out
        return moe.shard.all_reduce(whole)


class TokenDispatch(Protocol):
    """Moves (token, expert) pairs to the EP ranks that hold the experts and the outputs back.

    Contract: every rank of the EP group makes the same calls in the same order. A token rank
    calls ``route`` once per MoE layer a forward runs, then ``end_forward``; a rank that holds
    experts only calls ``serve`` once per forward, which runs its experts for whatever the token
    ranks send until their ``end_forward``. ``route(layer, x [n, H], ids [n, k], weights [n, k],
    experts, num_experts)`` returns ``sum_j weights[t, j] * expert_{ids[t, j]}(x_t)`` ``[n, H]``
    (``experts``: this rank's backend over its own experts, numbered from 0) and the layer's
    per-expert pair counts over every token rank (int64 ``[num_experts]``). ``seconds``: wall
    time spent in the collectives (waits for the other ranks included; CPU: exact, CUDA: the
    time to enqueue).
    """

    name: str
    seconds: float

    def route(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts,
              num_experts: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def end_forward(self, num_experts: int, device: torch.device) -> None: ...

    def serve(self, experts_by_layer: dict, num_experts: int, hidden: int, dtype: torch.dtype,
              device: torch.device) -> None: ...


class AllToAllDispatch:
    """Counts, rows and outputs, each one ``alltoall_base`` over the EP group (see the module doc)."""

    name = "alltoall"

    def __init__(self, group, rank: int, size: int, token_ranks: int):
        self.group, self.rank, self.size, self.token_ranks = group, rank, size, token_ranks
        self.seconds = 0.0

    def route(self, layer, x, ids, weights, experts, num_experts):
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair j = (token j // k, its (j % k)-th expert)
        hist = torch.zeros(num_experts, dtype=torch.int64, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        table = self._counts(layer, hist)
        tokens = order // k
        back = self._run(table, x.index_select(0, tokens), experts)
        # as GroupedExperts combines: weighted rows added onto their tokens in expert order
        back.mul_(weights.reshape(-1, 1).index_select(0, order))
        out = torch.zeros_like(x).index_add_(0, tokens, back)
        return out, _load(table, self.token_ranks)

    def end_forward(self, num_experts, device):
        self._counts(END_OF_FORWARD, torch.zeros(num_experts, dtype=torch.int64, device=device))

    def serve(self, experts_by_layer, num_experts, hidden, dtype, device):
        idle = torch.zeros(num_experts, dtype=torch.int64, device=device)
        none = torch.empty(0, hidden, dtype=dtype, device=device)
        while True:
            table = self._counts(LISTENING, idle)
            layer = table[0][0]
            if layer == END_OF_FORWARD:
                return
            if layer not in experts_by_layer:
                raise RuntimeError(f"EP rank {self.rank}: the token ranks dispatch layer {layer}, "
                                   f"which holds no experts here")
            self._run(table, none, experts_by_layer[layer])

    def _counts(self, header: int, hist: torch.Tensor) -> list[list[int]]:
        """Every rank's ``[header, *histogram]``, in rank order (one host sync: the split sizes)."""
        row = torch.cat([hist.new_tensor([header]), hist])
        send = row.expand(self.size, -1).contiguous()
        recv = torch.empty_like(send)
        t0 = time.perf_counter()
        self.group.alltoall_base(recv, send, [], [], dist.AllToAllOptions()).wait()
        table = recv.tolist()
        self.seconds += time.perf_counter() - t0
        headers = {r[0] for r in table[:self.token_ranks]}
        if len(headers) != 1:
            raise RuntimeError(f"EP rank {self.rank}: the token ranks are out of step (headers {sorted(headers)})")
        if header != LISTENING and headers != {header}:
            raise RuntimeError(f"EP rank {self.rank}: sent header {header}, the token ranks sent {headers.pop()}")
        return table

    def _run(self, table: list[list[int]], rows: torch.Tensor, experts) -> torch.Tensor:
        """Send ``rows`` (this rank's pairs, sorted by expert) to the experts' ranks, run this rank's
        experts on the rows every rank sent, and return the outputs of ``rows``, in their order."""
        per = (len(table[0]) - 1) // self.size
        mine = slice(1 + self.rank * per, 1 + (self.rank + 1) * per)
        sent = [sum(table[self.rank][1 + d * per:1 + (d + 1) * per]) for d in range(self.size)]
        per_source = [r[mine] for r in table]  # [source][local expert]: rows each source sends here
        received = [sum(c) for c in per_source]
        got = self._exchange(rows, received, sent)
        if len(got):
            local = torch.arange(per, device=got.device).repeat(self.size)
            ids = local.repeat_interleave(torch.tensor([c for cs in per_source for c in cs], device=got.device))
            got = experts.forward(got, ids.unsqueeze(1), torch.ones(len(got), 1, dtype=got.dtype, device=got.device))
        return self._exchange(got, sent, received)

    def _exchange(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        t0 = time.perf_counter()
        self.group.alltoall_base(out, rows.contiguous(), out_splits, in_splits, dist.AllToAllOptions()).wait()
        self.seconds += time.perf_counter() - t0
        return out


def _load(table: list[list[int]], token_ranks: int) -> torch.Tensor:
    """Pairs per expert over every token rank (what the operator's counter adds)."""
    return torch.tensor(table[:token_ranks], dtype=torch.int64)[:, 1:].sum(0)


DISPATCH: dict[str, type] = {"alltoall": AllToAllDispatch}


def create_dispatch(name: str, group, rank: int, size: int, token_ranks: int) -> TokenDispatch:
    try:
        cls = DISPATCH[name]
    except KeyError:
        raise ValueError(f"unknown EP dispatch {name!r} (choose from {', '.join(DISPATCH)})") from None
    return cls(group, rank, size, token_ranks)


def expert_shard(layout, rank: int) -> ExpertShard | None:
    """The ``ExpertShard`` of ``rank`` in ``layout`` (None at EP 1)."""
    if layout.ep == 1:
        return None
    place = layout.place(rank)
    return ExpertShard(place.ep_rank, layout.ep, layout.tp, place.tp_rank)
