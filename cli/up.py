"""``mesh up``: the whole mesh on this machine, from one command.

This module reads the flags, checks every one of them before anything starts (a bad
one is a line here, not a worker that crash-loops) and plans what to start: the flags
each worker and the gateway get. ``cli.localmesh`` runs the plan.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cli.flags import (
    CliError,
    add_api_key_flags,
    add_batch_flags,
    add_bus_flags,
    add_parser_flags,
    add_pool_flags,
    auth_config,
    batch_flags,
    engine_config,
    hash_key,
    nats_config,
)
from engine.flags import gpu_execution_argv, pipeline_argv, speculative_argv
from mesh.natsauth import NatsConfig
from mesh.planner.policy import PlannerConfig


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start the whole mesh on this machine (embedded NATS, tiny model)")
    add_bus_flags(p)
    add_pool_flags(p, multi_model=True)
    p.add_argument("--mock", action="store_true",
                   help="mocker workers instead of a model (with --model DIR: under its name, vocabulary and context)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--task", default="generate", choices=("generate", "embed"),
                   help="embed: serve the model(s) for /v1/embeddings only (--embed-workers of them, no "
                        "prefill or decode pools, no planner)")
    p.add_argument("--embed-workers", type=int, default=None, metavar="N",
                   help="embed workers per model (worker decode --task embed), a fixed pool beside the "
                        "generate pools (default: 0; 1 with --task embed)")
    p.add_argument("--pooling", default=None, choices=("last", "mean", "cls"),
                   help="embed workers: pooling of a model without sentence-transformers' modules.json")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--transports", default=None, help="KV transports for the workers, e.g. shm,nats")
    p.add_argument("--disagg-threshold", type=int, default=None)
    p.add_argument("--router", default=None, help="gateway routing: kv (default), round-robin, random, least-loaded")
    p.add_argument("--router-temperature", type=float, default=None, help="passed to the gateway")
    p.add_argument("--router-prefill-weight", type=float, default=None, help="passed to the gateway")
    p.add_argument("--router-decode-weight", type=float, default=None, help="passed to the gateway")
    p.add_argument("--peer-fetch", action="store_true",
                   help="decode workers fetch prefix blocks from peers, the router plans it (model workers need a host KV tier)")
    p.add_argument("--responses-ttl", type=float, default=None, metavar="SECONDS",
                   help="passed to the gateway: how long a stored response lives (default: 30 days)")
    p.add_argument("--gateway-workers", type=int, default=None,
                   help="gateway processes on the port (default: one per two cores, at most 4)")
    add_parser_flags(p)
    PlannerConfig.add_args(p)
    p.add_argument("--no-planner", action="store_true", help="fixed pools of --prefill and --decode workers")
    add_api_key_flags(p)
    add_batch_flags(p)
    p.set_defaults(func=run)


def default_model_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pdmesh" / "models" / "tiny"


def ensure_tiny_model(path: Path) -> Path:
    from engine.tiny import write_tiny_model, write_tokenizer

    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        write_tiny_model(path)
    elif write_tokenizer(path):  # written by an older pdmesh: the weights stand, the template is new
        print(f"mesh up: updated the default model's tokenizer and chat template in {path}", flush=True)
    return path


def run(args: argparse.Namespace) -> int:
    import asyncio

    from cli.localmesh import UpPlan, run_up

    embed = _embed_pool(args)
    if args.task == "generate" and (args.prefill < 0 or args.decode < 1):
        raise CliError("--decode must be >= 1 and --prefill >= 0")
    models = _models(args)
    if embed:  # a pooling the embed workers cannot serve: one line now, not workers that crash-loop
        from engine.pooling import PoolingConfig

        for m in models:
            PoolingConfig.from_dir(m, args.pooling or "last")
    key_flags = _hash_key_flags(args)
    worker_flags = _worker_flags(args) + key_flags
    gateway_flags, gateway_env = _gateway_flags(args, models)
    gateway_flags += key_flags
    if args.min_prefill is None:
        args.min_prefill = min(1, args.prefill)
    planner = None if args.no_planner or args.task == "embed" else PlannerConfig.from_args(args)
    if planner is not None:  # start inside the planner's bounds
        args.prefill = min(max(args.prefill, planner.min_prefill), planner.max_prefill)
        args.decode = min(max(args.decode, planner.min_decode), planner.max_decode)
    plan = UpPlan(models=models, mock=args.mock, prefill=args.prefill, decode=args.decode, host=args.host,
                  port=args.port, nats=_nats(args), ns=args.ns, worker_flags=worker_flags,
                  gateway_flags=gateway_flags, planner=planner, served_name=args.served_name,
                  gateway_env=gateway_env, embed=embed,
                  embed_flags=["--task", "embed", *(["--pooling", args.pooling] if args.pooling else [])])
    return asyncio.run(run_up(plan))


def _embed_pool(args: argparse.Namespace) -> int:
    """Embed workers per model. ``--task embed``: only those (the generate pools are 0)."""
    n = args.embed_workers if args.embed_workers is not None else int(args.task == "embed")
    if n < 0 or (args.task == "embed" and n < 1):
        raise CliError("--embed-workers must be >= 0 (>= 1 with --task embed)")
    if n and args.mock:
        raise CliError("embed workers run a model: --task embed and --embed-workers do not take --mock")
    if args.task == "embed":
        args.decode = args.prefill = 0
    return n


def _hash_key_flags(args: argparse.Namespace) -> list[str]:
    """Every process of the mesh hashes blocks under one secret: ``--hash-key-file`` or
    ``MESH_HASH_KEY`` as given (the children inherit the variable), else a new one, written 0600
    in this run's directory (removed when ``mesh up`` exits) and passed by its path."""
    import atexit
    import shutil
    import tempfile

    from kvstore.hashing import generate_hash_key
    from mesh.config import settings

    if args.hash_key_file:
        hash_key(args)  # a bad file is one line here, not crash-looping workers
        return ["--hash-key-file", str(Path(args.hash_key_file).resolve())]
    if settings().hash_key:
        hash_key(args)
        return []
    run_dir = Path(tempfile.mkdtemp(prefix="pdmesh-up-"))  # 0700
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    path = run_dir / "hash.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_hash_key().hex() + "\n")
    return ["--hash-key-file", str(path)]


def _models(args: argparse.Namespace) -> list[str]:
    """The model directories, one pool pair each, checked with the flags (as a worker's engine
    config) before anything starts."""
    if args.mock and not args.model:  # --mock alone: the mocker under the name "mock", no tokenizer
        return []
    models = [str(m) for m in (args.model or [ensure_tiny_model(default_model_dir())])]
    names = [Path(m).name for m in models]
    if len(set(names)) != len(names):
        raise CliError(f"two --model directories share a name ({', '.join(names)}): models are named by directory")
    if args.served_name and len(models) > 1:
        raise CliError("--served-name names one model; with several --model each is named by its directory")
    for m in models:
        args.model = m
        engine_config(args, mock=args.mock)
    return models


def _worker_flags(args: argparse.Namespace) -> list[str]:
    """The pool flags every worker gets, as given."""
    flags = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-prefill-with-decode", str(args.max_prefill_with_decode),
             "--kv-memory-fraction", str(args.kv_memory_fraction)]
    if args.tp != 1:
        flags += ["--tp", str(args.tp)]
    flags += pipeline_argv(args) + gpu_execution_argv(args) + speculative_argv(args)
    for spec in args.lora:
        flags += ["--lora", spec]
    if args.max_loras is not None:
        flags += ["--max-loras", str(args.max_loras)]
    if args.max_lora_rank != 16:
        flags += ["--max-lora-rank", str(args.max_lora_rank)]
    if args.grammar_backend != "llguidance" or args.grammar_threads:
        flags += ["--grammar-backend", args.grammar_backend, "--grammar-threads", str(args.grammar_threads)]
    if args.grammar_spin_ms != 3.0:
        flags += ["--grammar-spin-ms", str(args.grammar_spin_ms)]
    for name in ("device_kv_blocks", "host_kv_gb", "disk_kv_dir", "disk_kv_gb", "host_kv_blocks", "disk_kv_blocks",
                 "dtype", "device", "served_name", "transports", "disagg_threshold"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.mock:
        engine_config(args, mock=True)  # a bad mocker flag is one line here, not a crash-looping worker
        flags += ["--mock-speedup", str(args.mock_speedup)]
        flags += [f for t in args.mock_timing for f in ("--mock-timing", t)]
        if args.speculative:
            flags += ["--mock-spec-acceptance", str(args.mock_spec_acceptance)]
    flags += ["--peer-fetch"] if args.peer_fetch else []
    return flags


def _gateway_flags(args: argparse.Namespace, models: list[str]) -> tuple[list[str], dict[str, str]]:
    """The gateway's flags, and its environment: the API keys, which a command line would show."""
    flags = ["--served-name", args.served_name] if args.served_name and models else []
    if args.router:
        flags += ["--router", args.router]
    for name in ("router_temperature", "router_prefill_weight", "router_decode_weight", "tool_call_parser",
                 "reasoning_parser", "responses_ttl"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    auth = auth_config(args)
    env = {"MESH_API_KEYS": ",".join(auth.keys)} if auth.keys else {}
    if auth.admin_keys:
        env["MESH_ADMIN_API_KEYS"] = ",".join(auth.admin_keys)
    if auth.key_file:
        flags += ["--api-key-file", str(Path(auth.key_file).resolve())]
    for name in ("api_key_max_concurrent", "api_key_rpm"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.metrics_auth:
        flags.append("--metrics-auth")
    if args.peer_fetch:
        flags += ["--router-peer-fetch"]
    flags += batch_flags(args)
    if args.gateway_workers is not None:
        if args.gateway_workers < 1:
            raise CliError("--gateway-workers must be >= 1")
        flags += ["--workers", str(args.gateway_workers)]
    return flags, env


def _nats(args: argparse.Namespace) -> NatsConfig | None:
    """The servers of ``--nats``, or None: an embedded server, one, with no credentials."""
    if args.nats:
        return nats_config(args, "")
    if any(getattr(args, f) for f in ("nats_creds", "nats_nkey", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")):
        raise CliError("--nats-creds, --nats-nkey and --nats-tls-* are for the servers of --nats; "
                       "the embedded server takes no credentials")
    if args.js_replicas not in (None, 1):
        raise CliError("the embedded NATS is one server: --js-replicas above 1 needs --nats (a cluster)")
    return None
