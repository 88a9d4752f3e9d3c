"""``mesh worker ROLE``: run one worker, the class its role names in ``ROLES``."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cli.flags import CliError, add_bus_flags, add_pool_flags, engine_config, hash_key, nats_config

if TYPE_CHECKING:
    from worker.base import WorkerBase


@dataclass(frozen=True)
class Role:
    """A kind of worker. Its class is imported by name when one starts, so that a worker loads its
    own layer only (a mock worker never loads torch)."""

    worker: str  # "module:Class", a WorkerBase
    nats_role: str  # names its inbox prefix on NATS
    simulated: bool = False  # always on the mocker's engine (others with --mock)

    def worker_class(self) -> type[WorkerBase]:
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)


ROLES = {
    "decode": Role("decode.worker:DecodeWorker", "decode"),
    "prefill": Role("prefill.worker:PrefillWorker", "prefill"),
    "mock": Role("mocker.worker:MockWorker", "decode", simulated=True),  # a decode worker on the mocker engine
    "embed": Role("decode.embed:EmbedWorker", "decode"),  # worker decode --task embed: embeddings, no KV cache
}
TASKS = ("generate", "embed")


def role_of(args: argparse.Namespace) -> str:
    """``worker decode --mock`` is the mocker's decode worker; ``worker prefill --mock`` a prefill
    worker on the mocker's engine; ``worker decode --task embed`` an embed worker."""
    if args.task == "embed":
        if args.role != "decode" or args.mock:
            raise CliError("--task embed runs a decode worker on a model: mesh worker decode --task embed --model DIR")
        return "embed"
    return "mock" if args.mock and args.role == "decode" else args.role


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="run one worker")
    p.add_argument("role", choices=list(ROLES), help="mock: a decode worker on the mocker engine")
    add_bus_flags(p)
    add_pool_flags(p)
    p.add_argument("--mock", action="store_true", help="use the mocker engine instead of a model")
    p.add_argument("--task", default="generate", choices=TASKS,
                   help="decode: generate (default), or embed: serve /v1/embeddings only (pooled hidden states, "
                        "no KV cache), as a pool of its own")
    p.add_argument("--pooling", default="last", choices=("last", "mean", "cls"),
                   help="--task embed: pooling of a model whose directory has no sentence-transformers "
                        "modules.json (which wins when present)")
    p.add_argument("--worker-id", default="")
    p.add_argument("--transports", default="", help="KV transports to offer/use, best first (default: shm,nixl,nats on CPU; cuda_ipc,nccl,nixl,nats on CUDA; nixl if installed and TP 1; with --pp > 1: shm,nats on CPU, nats on CUDA)")
    p.add_argument("--disagg-threshold", type=int, default=512, help="decode: prefill remotely from this many uncached tokens")
    p.add_argument("--prefill-timeout", type=float, default=10.0, help="decode: seconds before falling back to local prefill")
    p.add_argument("--prefill-capacity", type=int, default=4, help="prefill: jobs held at once")
    p.add_argument("--stream-interval-ms", type=float, default=1.0,
                   help="decode: at most one token message per gateway per this many ms (0: as soon as the event loop is free)")
    p.add_argument("--kv-event-interval-ms", type=float, default=100.0,
                   help="decode: at most one KV event batch per this many ms (the router hears of a block at most "
                        "this much later; 0: as soon as the last batch is sent)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: any free port, -1: off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics listens on (default loopback; 0.0.0.0 or the pod IP to be scraped)")
    p.add_argument("--max-queued", type=int, default=0,
                   help="decode: queued requests beyond which new ones are refused with 429 (0: 4 x max-num-seqs)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight work may run after SIGTERM (after SIGINT: 2 s; a second signal: none)")
    p.add_argument("--peer-fetch", action="store_true",
                   help="decode: serve prefix blocks to peers and fetch those a router's decision names "
                        "(model workers need a host KV tier; the mocker simulates the transfer)")
    p.add_argument("--peer-fetch-timeout", type=float, default=5.0,
                   help="decode: seconds a peer fetch may take before the request prefills instead")
    p.add_argument("--peer-pin-max-s", type=float, default=10.0,
                   help="decode: the longest a peer's fetch keeps this worker's blocks pinned, whatever "
                        "deadline the peer asks for")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mesh.config import settings
    from worker.base import WorkerSettings

    name = role_of(args)
    role = ROLES[name]
    mock = args.mock or role.simulated
    nats = nats_config(args, role.nats_role)
    ws = WorkerSettings(
        nats_url=nats.url, nats=nats, ns=args.ns or settings().ns, worker_id=args.worker_id,
        engine=replace(engine_config(args, mock=mock), hash_key=hash_key(args)),
        transports=tuple(t for t in args.transports.split(",") if t),
        disagg_threshold=args.disagg_threshold, prefill_timeout=args.prefill_timeout,
        stream_interval_ms=args.stream_interval_ms,
        kv_event_interval_ms=args.kv_event_interval_ms,
        prefill_capacity=args.prefill_capacity, metrics_port=args.metrics_port, max_queued=args.max_queued,
        drain_timeout=args.drain_timeout, metrics_host=args.metrics_host,
        peer_fetch=args.peer_fetch and name == "decode",  # the mocker's is in its MockConfig
        peer_fetch_timeout=args.peer_fetch_timeout, peer_pin_max_s=args.peer_pin_max_s, pooling=args.pooling,
    )
    if args.drain_timeout < 0:
        raise CliError("--drain-timeout must be >= 0")
    if args.peer_pin_max_s <= 0:
        raise CliError("--peer-pin-max-s must be > 0")
    ws.transport_names()  # a bad transport list is a one-line error, not a dead worker
    if name == "embed":
        _check_embed(ws)
    worker = role.worker_class()(ws)
    _run_loop(worker.run())
    return worker.exit_code


def _check_embed(ws) -> None:
    """An embed worker runs the plain forward: a flag of the generate path is an error, not ignored."""
    e = ws.engine
    given = [flag for flag, on in (("--tp", e.tp != 1), ("--pp", e.pp != 1), ("--lora", bool(e.loras)), ("--speculative", bool(e.speculative)),
                                   ("--host-kv-gb/--host-kv-blocks", e.has_host_tier), ("--peer-fetch", ws.peer_fetch))
             if on]
    if given:
        raise CliError(f"--task embed does not take {', '.join(given)} (an embed worker keeps no KV cache)")
    from engine.pooling import PoolingConfig

    PoolingConfig.from_dir(e.model, ws.pooling)  # a pooling it cannot serve: one line (ModelError) now


def _run_loop(main) -> None:
    """On uvloop where it is installed (uvicorn[standard] brings it; the gateway runs on it too):
    a worker's event loop sends every step's tokens, and the selector loop's Python write path
    and per-iteration bookkeeping cost a mock worker more CPU than its engine at real pace."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
