"""The TP 2 cases of ``python -m bench transfer --hosts 2 --tp 2``: the same request's KV over nixl
between pools of two ranks, each rank's part in a process of its own with its own NIXL agent, as
a ``--tp 2`` worker's are (``engine.parallel`` starts the ranks of a worker; here a helper process
holds only its KV part and serves its agent's channel, ``kvstore.transfer.nixl_ranks``).

    nixl          TP 1 -> TP 1  one transfer: a descriptor per (layer, K|V) plane and run of blocks
    nixl_tp2      TP 2 -> TP 2  two transfers at once, rank r to rank r: half the heads each, the
                                same descriptors as at TP 1 (a part's heads are whole on both sides)
    nixl_tp2to1   TP 2 -> TP 1  two transfers into one pool: a descriptor per token row (each rank
                                writes its half of every row's heads)

Run on its own (root: two network namespaces on a veth pair, as ``transfer --hosts 2``):

    sudo python -m bench transfer-tp [--mb 16 256] [--repeat 5]

which is ``python -m bench transfer --hosts 2 --transport nixl --tp 2`` reported with the TP 2
cases' GB/s over TP 1's for the same request.

``python -m bench.kv.transfer_tp FD SPEC PATH`` is a helper rank: its part of the pool in the
shared-memory file PATH (its rank 0 maps it, to fill and check it), its agent on channel FD.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser

BENCHMARK = Benchmark(
    name="transfer-tp",
    measures="GB/s of one prompt's KV over nixl between two network namespaces (root) from a pool of two "
             "TP ranks (an agent each) into two and into one, against TP 1 -> TP 1 for the same request",
    minutes=1,
    smoke=("--dry-run",),
)

# variant -> (the sender's pool: ranks, the receiver's pool: ranks)
VARIANTS = {"nixl": (1, 1), "nixl_tp2": (2, 2), "nixl_tp2to1": (2, 1)}


def variants(tp: int) -> list[str]:
    """The nixl cases a run compares: TP 1 alone, or with ``--tp 2`` the TP 2 ones beside it."""
    return ["nixl"] if tp == 1 else list(VARIANTS)


class TwoRanks:
    """A pool of two TP ranks: rank 0's part here, rank 1's in a helper process with its own agent."""

    def __init__(self, spec, name: str):
        import socket

        from kvstore.cache import KVCache, KVCacheSpec, ShardedKVCache
        from kvstore.transfer.nixl_ranks import RankAgentLink
        from kvstore.transfer.shm import shm_path

        half = KVCacheSpec(spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads // 2, spec.head_dim,
                           spec.dtype)
        self.path = shm_path(f"bench-{name}-{os.getpid()}")
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.kv.transfer_tp", str(theirs.fileno()),
                                          json.dumps(half.to_dict()), self.path], pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        self.conn = conn = Connection(ours.detach())
        if not conn.poll(120) or conn.recv() != "ready":
            raise SystemExit("a helper rank did not start")
        other = KVCache.attach(half, self.path)
        other.owner = RankAgentLink(conn, 1)
        self.kv = ShardedKVCache([KVCache(half, torch.device("cpu")), other], tp=2)

    def fill(self) -> None:
        for part in self.kv.parts():
            part.cache.tensor.normal_()

    def close(self) -> None:
        self.conn.close()  # the helper's end of the channel: it leaves
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        Path(self.path).unlink(missing_ok=True)


def _helper(fd: int, spec_json: str, path: str) -> None:
    from kvstore.cache import KVCache, KVCacheSpec
    from kvstore.transfer.nixl_ranks import RankAgentService

    conn = Connection(fd)
    kv = KVCache(KVCacheSpec.from_dict(json.loads(spec_json)), torch.device("cpu"), shm_path=path)
    try:
        conn.send("ready")
        RankAgentService(conn, kv.tensor).start().join()  # until rank 0 closes the channel (or dies)
    finally:
        Path(path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    from bench.kv import transfer_hosts

    p = parser(BENCHMARK, __doc__)
    p.add_argument("--mb", type=int, nargs="+", default=[16, 256], help="MB per transfer")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=50.0,
                   help="ms between taking a job (nixl asks its grant) and sending (the prefill)")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")} or {
        "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
    run = transfer_hosts.plan if args.dry_run else transfer_hosts.run_hosts
    rows = run(args.mb, args.repeat, "nixl", env, args.compute_ms, True, 2)
    figures = transfer_hosts.report(rows, args.repeat, env)
    # the TP 2 cases against TP 1, size by size (the figure the issue asks for)
    figures["tp_vs_tp1"] = {str(s["mb"]): {
        n: round(s[f"{n}_gbps"] / s["nixl_gbps"], 3) for n in VARIANTS if n != "nixl" and s.get(f"{n}_gbps")}
        for s in figures["sizes"] if s.get("nixl_gbps")}
    return emit(BENCHMARK, figures, args)


if __name__ == "__main__":
    _helper(int(sys.argv[1]), sys.argv[2], sys.argv[3])
