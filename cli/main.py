"""The ``mesh`` command line.

Each subcommand's work lives in its own module and is imported only when that
subcommand runs. Errors a user can fix print as one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run the engine in this process and print completions")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-kv-blocks", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    add_lora_flags(p)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME",
                   help="run the prompts on this --lora adapter (once: every prompt; once per prompt: in order; "
                        "'' for the base model)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=cmd_generate)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="load a LoRA adapter (PEFT directory) under NAME; repeatable")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapters one step can run (device slots, least recently used out); "
                        "default 4 with --lora, else LoRA is off")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank the slots hold")


def lora_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the LoRA flags (a CliError for a malformed --lora)."""
    loras = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora takes NAME=DIR, got {spec!r}")
        loras.append((name, path))
    return {"loras": tuple(loras), "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}


def _add_model(sub) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    t = msub.add_parser("tiny", help="write a random-weight Llama (or Qwen3-MoE) checkpoint with a real tokenizer")
    t.add_argument("dir", help="output directory")
    t.add_argument("--size", default="tiny", choices=["tiny", "small", "moe", "small-moe"],
                   help="moe, small-moe: a mixture-of-experts Qwen3-MoE checkpoint")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_model_tiny)


def add_pool_flags(p: argparse.ArgumentParser, multi_model: bool = False) -> None:
    """Engine and KV pool flags shared by every role that runs an engine (and by ``mesh up``)."""
    if multi_model:
        p.add_argument("--model", action="append", default=None,
                       help="Hugging Face model directory; repeat to serve several models on one mesh")
    else:
        p.add_argument("--model", default=None, help="Hugging Face model directory")
    p.add_argument("--served-name", default=None, help="model name on the bus and in the API (default: the directory name)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-kv-blocks", type=int, default=None, help="cap the device KV pool (default: what memory allows)")
    p.add_argument("--host-kv-gb", type=float, default=None, help="host KV tier: offload cold blocks to this much RAM (pinned on GPU)")
    p.add_argument("--disk-kv-dir", default=None, help="disk KV tier: keep reused blocks evicted from the host tier here")
    p.add_argument("--disk-kv-gb", type=float, default=None, help="cap of the disk KV tier (default 8)")
    p.add_argument("--host-kv-blocks", type=int, default=None,
                   help="host KV tier in blocks (instead of --host-kv-gb; the mocker's virtual host tier)")
    p.add_argument("--disk-kv-blocks", type=int, default=None,
                   help="cap of the disk KV tier in blocks (instead of --disk-kv-gb; the mocker's virtual disk tier)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-memory-fraction", type=float, default=0.85,
                   help="GPU: the share of the device this worker may use, weights and KV (two models on one GPU: 0.4 each)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel: shard the model over this many ranks (processes; one GPU each on CUDA)")
    add_gpu_execution_flags(p)
    p.add_argument("--grammar-backend", default="llguidance", choices=("llguidance", "xgrammar"),
                   help="grammar engine of constrained output (xgrammar: pip install pdmesh[xgrammar])")
    p.add_argument("--grammar-threads", type=int, default=0,
                   help="threads that fill the token masks of constrained rows (0: the grammar engine's default)")
    p.add_argument("--grammar-spin-ms", type=float, default=3.0,
                   help="how long the grammar process polls for the next step before it sleeps (0: it always "
                        "sleeps; each step's message then wakes it, ~60 us of the engine thread on a small VM)")
    p.add_argument("--mock-speedup", type=float, default=1.0, help="mocker: run the timing model this much faster")
    add_lora_flags(p)
    p.add_argument("--mock-timing", action="append", default=[], metavar="FIELD=VALUE",
                   help="mocker: set a timing-model field, e.g. network_gb_per_s=50 (repeatable)")


def add_gpu_execution_flags(p: argparse.ArgumentParser) -> None:
    """How a model worker runs on a GPU (issue 21): each off by default until measured on one."""
    p.add_argument("--attention-backend", default=None,
                   help="flashinfer (CUDA default), flashinfer-ragged (prefill over this step's K/V as a ragged "
                        "batch plus the cached prefix) or torch (CPU default)")
    p.add_argument("--cuda-graphs", action="store_const", const=True, default=None,
                   help="GPU: replay decode steps from CUDA graphs (FlashInfer attention, --tp 1)")
    p.add_argument("--enforce-eager", action="store_true", help="GPU: never use CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling and output processing with the device's step (--tp 1)")
    p.add_argument("--fused-kernels", default="",
                   help="GPU: FlashInfer kernels for these ops, comma-separated: add_rmsnorm, silu_and_mul, "
                        "rope, sampling; or all")


def gpu_execution_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of ``add_gpu_execution_flags`` (ValueError on a bad value)."""
    from engine.kernels import parse_fused_kernels

    return {"attention_backend": args.attention_backend, "cuda_graphs": args.cuda_graphs,
            "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
            "fused_kernels": parse_fused_kernels(args.fused_kernels)}


def gpu_execution_flags(args: argparse.Namespace) -> list[str]:
    """The same flags again, for the workers ``mesh up`` starts."""
    flags = []
    if args.attention_backend:
        flags += ["--attention-backend", args.attention_backend]
    if args.cuda_graphs:
        flags += ["--cuda-graphs"]
    if args.enforce_eager:
        flags += ["--enforce-eager"]
    if args.async_scheduling is not None:
        flags += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    if args.fused_kernels:
        flags += ["--fused-kernels", args.fused_kernels]
    return flags


def add_bus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None,
                   help="NATS URL, or several comma-separated (a cluster); user:password@ or a token@ in "
                        "the URL authenticate (default: $MESH_NATS_URL, or an embedded server for mesh up)")
    p.add_argument("--ns", default=None, help="subject namespace (default: mesh)")
    p.add_argument("--nats-creds", default=None, metavar="FILE", help="NATS user JWT + nkey seed ($MESH_NATS_CREDS)")
    p.add_argument("--nats-nkey", default=None, metavar="FILE", help="NATS nkey seed file ($MESH_NATS_NKEY)")
    p.add_argument("--nats-tls-ca", default=None, metavar="FILE",
                   help="CA of the NATS servers' certificates; implies TLS ($MESH_NATS_TLS_CA)")
    p.add_argument("--nats-tls-cert", default=None, metavar="FILE", help="TLS client certificate ($MESH_NATS_TLS_CERT)")
    p.add_argument("--nats-tls-key", default=None, metavar="FILE", help="its private key ($MESH_NATS_TLS_KEY)")
    p.add_argument("--nats-connect-timeout", type=float, default=None, metavar="SECONDS",
                   help="keep trying to reach NATS this long at start (default 10; $MESH_NATS_CONNECT_TIMEOUT)")
    p.add_argument("--js-replicas", type=int, default=None, metavar="N",
                   help="replicas of the JetStream bucket and streams this process creates (default 1; "
                        "3 on a 3-node cluster; $MESH_JS_REPLICAS)")


def nats_config(args: argparse.Namespace, role: str, url: str | None = None):
    """The process's one ``NatsConfig``: ``--nats`` and the ``--nats-*`` flags over ``MESH_NATS_*``."""
    from mesh.config import settings
    from mesh.natsauth import NatsConfig

    url = url or args.nats or settings().nats_url
    if not url:
        raise CliError("--nats URL is required (or MESH_NATS_URL)")
    return NatsConfig.build(url, role=role, creds=args.nats_creds, nkey=args.nats_nkey, tls_ca=args.nats_tls_ca,
                            tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key,
                            js_replicas=args.js_replicas, connect_timeout=args.nats_connect_timeout)


def _add_worker(sub) -> None:
    p = sub.add_parser("worker", help="run one worker")
    p.add_argument("role", choices=["decode", "prefill", "mock"], help="mock: a decode worker on the mocker engine")
    add_bus_flags(p)
    add_pool_flags(p)
    p.add_argument("--mock", action="store_true", help="use the mocker engine instead of a model")
    p.add_argument("--worker-id", default="")
    p.add_argument("--transports", default="", help="KV transports to offer/use, best first (default: shm,nats on CPU; cuda_ipc,nccl,nats on CUDA)")
    p.add_argument("--disagg-threshold", type=int, default=512, help="decode: prefill remotely from this many uncached tokens")
    p.add_argument("--prefill-timeout", type=float, default=10.0, help="decode: seconds before falling back to local prefill")
    p.add_argument("--prefill-capacity", type=int, default=4, help="prefill: jobs held at once")
    p.add_argument("--stream-interval-ms", type=float, default=1.0,
                   help="decode: at most one token message per gateway per this many ms (0: as soon as the event loop is free)")
    p.add_argument("--kv-event-interval-ms", type=float, default=5.0,
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
    p.set_defaults(func=cmd_worker)


def _add_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    add_bus_flags(p)
    p.add_argument("--model", action="append", default=[], help="model directory (tokenizer, chat template); repeatable")
    p.add_argument("--served-name", action="append", default=[], help="name for each --model, in order")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-inflight", type=int, default=1024, help="admitted requests at once; beyond: 429")
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--router", default="kv", choices=["kv", "round-robin", "random", "least-loaded"],
                   help="how to pick a decode worker (default: kv, the KV-aware router)")
    p.add_argument("--router-temperature", type=float, default=0.0, help="kv router: 0 = cheapest, > 0 = softmax")
    p.add_argument("--router-prefill-weight", type=float, default=None,
                   help="kv router: weight of a block to prefill (default 1.0)")
    p.add_argument("--router-decode-weight", type=float, default=None,
                   help="kv router: weight of a block held by running requests (default 0.1)")
    p.add_argument("--router-peer-fetch", action="store_true",
                   help="kv router: plan fetches of prefix blocks from peers where cheaper than prefill")
    p.add_argument("--first-token-timeout", type=float, default=120.0,
                   help="seconds to wait for a worker's first chunk before answering 504")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds a started stream may go silent before it ends with a timeout error")
    p.add_argument("--drain-timeout", type=float, default=3.0,
                   help="seconds open streams may run after SIGTERM or SIGINT before they are cut")
    add_api_key_flags(p)
    p.add_argument("--workers", type=int, default=None,
                   help="gateway processes on the port (SO_REUSEPORT; default: one per two cores, at most 4)")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers N
    add_parser_flags(p)
    p.set_defaults(func=cmd_gateway)


def add_api_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY); repeatable; also $MESH_API_KEYS "
                        "(comma-separated). Prefer the file or the variable: a command line is visible to other users")
    p.add_argument("--admin-api-key", action="append", default=[], metavar="KEY",
                   help="a key that may also load and unload LoRA adapters (role admin); repeatable; also "
                        "$MESH_ADMIN_API_KEYS (comma-separated)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="keys, one per line: KEY [name=LABEL] [max_concurrent=N] [rpm=N] [role=admin]; reread "
                        "on SIGHUP and when it changes")
    p.add_argument("--api-key-max-concurrent", type=int, default=0, metavar="N",
                   help="requests in flight per key, for keys without their own (0: no limit); beyond: 429")
    p.add_argument("--api-key-rpm", type=int, default=0, metavar="N",
                   help="requests per minute per key, for keys without their own (0: no limit); beyond: 429")
    p.add_argument("--metrics-auth", action="store_true", help="/metrics needs an API key too (default: open)")


def auth_config(args: argparse.Namespace):
    from gateway.auth import AuthConfig, KeyLimits
    from mesh.config import settings

    if args.api_key_max_concurrent < 0 or args.api_key_rpm < 0:
        raise CliError("--api-key-max-concurrent and --api-key-rpm must be >= 0")
    if args.api_key_file and not Path(args.api_key_file).is_file():
        raise CliError(f"--api-key-file {args.api_key_file}: no such file")
    auth = AuthConfig(keys=(*settings().api_keys, *args.api_key),
                      admin_keys=(*settings().admin_api_keys, *args.admin_api_key), key_file=args.api_key_file,
                      limits=KeyLimits(args.api_key_max_concurrent, args.api_key_rpm),
                      metrics_auth=args.metrics_auth)
    if auth.key_file:
        from gateway.auth import KeyRing

        KeyRing(auth)  # a file that does not parse: one line now
    return auth


def add_parser_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's output parsers, when a model's chat template does not show its formats."""
    from gateway.reasoning import REASONING_FORMATS
    from gateway.tools import TOOL_FORMATS

    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_FORMATS),
                   help="the tool-call format of every model (default: found in each chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=["none", *sorted(REASONING_FORMATS)],
                   help="the reasoning format of every model, or none (default: found in each chat template)")


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start the whole mesh on this machine (embedded NATS, tiny model)")
    add_bus_flags(p)
    add_pool_flags(p, multi_model=True)
    p.add_argument("--mock", action="store_true",
                   help="mocker workers instead of a model (with --model DIR: under its name, vocabulary and context)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: aggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
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
    p.add_argument("--gateway-workers", type=int, default=None,
                   help="gateway processes on the port (default: one per two cores, at most 4)")
    add_parser_flags(p)
    add_planner_flags(p)
    p.add_argument("--no-planner", action="store_true", help="fixed pools of --prefill and --decode workers")
    add_api_key_flags(p)
    p.set_defaults(func=cmd_up)


def add_planner_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft-ms", type=float, default=2000.0, help="planner: TTFT p90 target")
    p.add_argument("--itl-ms", type=float, default=100.0, help="planner: ITL p90 target")
    p.add_argument("--min-prefill", type=int, default=None,
                   help="default: 1 (mesh up: 0 when started with --prefill 0, i.e. aggregated)")
    p.add_argument("--max-prefill", type=int, default=4)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=4)
    p.add_argument("--planner-window", type=float, default=5.0, help="planner: seconds per decision")


def planner_config(args: argparse.Namespace):
    from mesh.planner.policy import PlannerConfig

    return PlannerConfig(
        ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
        min_prefill=1 if args.min_prefill is None else args.min_prefill, max_prefill=args.max_prefill,
        min_decode=args.min_decode, max_decode=args.max_decode, window_s=args.planner_window,
    )


def _add_planner(sub) -> None:
    p = sub.add_parser("planner", help="size the prefill and decode pools against TTFT/ITL targets")
    add_bus_flags(p)
    add_planner_flags(p)
    p.add_argument("--connector", default="virtual", choices=["virtual", "kubernetes"],
                   help="kubernetes: scale the pool Deployments; virtual: publish decisions only")
    p.add_argument("--model-name", default=None, help="plan the pools of this served model (default: all workers)")
    p.add_argument("--k8s-namespace", default=None, help="default: the pod's namespace")
    p.add_argument("--prefill-deployment", default="pdmesh-prefill")
    p.add_argument("--decode-deployment", default="pdmesh-decode")
    p.add_argument("--k8s-api", default=None, help="default: the in-cluster API server")
    p.set_defaults(func=cmd_planner)


def _add_top(sub) -> None:
    p = sub.add_parser("top", help="a live view of the mesh: workers, load, KV usage, planner")
    add_bus_flags(p)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(func=cmd_top)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="pdmesh: disaggregated prefill/decode serving")
    parser.add_argument("--log-level", default=None, help="default: $MESH_LOG_LEVEL or WARNING")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_model(sub)
    _add_generate(sub)
    _add_worker(sub)
    _add_gateway(sub)
    _add_up(sub)
    _add_planner(sub)
    _add_top(sub)
    return parser


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import write_tiny_model

    out = write_tiny_model(args.dir, size=args.size, seed=args.seed)
    print(out)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig, ModelConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from mesh.tokenizer import Tokenizer

    model = Path(args.model)
    ModelConfig.from_dir(model)  # names a missing or unsupported model before anything loads
    tokenizer = Tokenizer(model)
    adapters = args.adapter or [""]
    if len(adapters) not in (1, len(args.prompts)):
        raise CliError(f"--adapter given {len(adapters)} times for {len(args.prompts)} prompts: give it once, "
                       "or once per prompt")
    engine = Engine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_kv_blocks=args.device_kv_blocks,
            **lora_config(args),
        )
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = [tokenizer.encode(p) for p in args.prompts]
    names = [name or None for name in adapters * (len(prompts) // len(adapters))]
    seqs = engine.generate(prompts, params, lora=names)
    for text, ids, seq in zip(args.prompts, prompts, seqs, strict=True):
        completion = tokenizer.decode(seq.output_token_ids)
        if args.json:
            print(json.dumps({
                "prompt": text,
                "adapter": seq.lora.name if seq.lora else None,
                "prompt_token_ids": ids,
                "token_ids": seq.output_token_ids,
                "text": completion,
                "finish_reason": seq.status.finish_reason,
            }))
        else:
            print(f"{text}{completion}")
    return 0


def engine_config(args: argparse.Namespace, mock: bool = False):
    """The engine (or mocker) configuration from the pool flags."""
    from mesh.config import settings

    if mock:
        from mocker.engine import MockConfig

        if args.host_kv_gb or args.disk_kv_dir or args.disk_kv_gb:
            raise CliError("the mocker has no KV bytes: give its tiers in blocks (--host-kv-blocks, "
                           "--disk-kv-blocks); --host-kv-gb, --disk-kv-gb and --disk-kv-dir are for model workers")
        if args.tp != 1:
            raise CliError("the mocker has no model to shard: --tp is for model workers")
        if args.lora or args.max_loras:
            raise CliError("the mocker runs no model: --lora and --max-loras are for model workers")
        if any(gpu_execution_flags(args)):
            raise CliError("the mocker runs no model: --attention-backend, --cuda-graphs, --enforce-eager, "
                           "--async-scheduling and --fused-kernels are for model workers")
        kw = {"block_size": args.block_size, "speedup": args.mock_speedup, "max_num_seqs": args.max_num_seqs,
              "timing": mock_timing(args.mock_timing), "peer_fetch": getattr(args, "peer_fetch", False)}
        if getattr(args, "peer_fetch_timeout", None) is not None:
            kw["fetch_timeout"] = args.peer_fetch_timeout
        if args.device_kv_blocks:
            kw["num_blocks"] = args.device_kv_blocks
        if args.model:  # simulate this model: its name, vocabulary and context (the gateway brings its tokenizer)
            from engine.config import ModelConfig

            mc = ModelConfig.from_dir(args.model)
            kw.update(model_name=Path(args.model).name, vocab_size=mc.vocab_size, max_model_len=mc.max_position)
        if args.served_name:
            kw["model_name"] = args.served_name
        if args.host_kv_blocks:
            kw["host_kv_blocks"] = args.host_kv_blocks
        if args.disk_kv_blocks:
            kw["disk_kv_blocks"] = args.disk_kv_blocks
        try:
            return MockConfig(**kw)
        except ValueError as e:
            raise CliError(str(e)) from None
    if getattr(args, "peer_fetch", False) and not (args.host_kv_gb or args.host_kv_blocks):
        raise CliError("--peer-fetch needs a host KV tier (--host-kv-gb or --host-kv-blocks): "
                       "fetched blocks are staged and sent through it")
    if args.mock_timing:
        raise CliError("--mock-timing is for the mocker")
    from engine.config import EngineConfig, ModelConfig

    model = args.model or settings().model
    if not model:
        raise CliError("--model DIR is required (or MESH_MODEL)")
    mc = ModelConfig.from_dir(model)
    mc.check_tp(args.tp)
    tiers = {"host_kv_gb": args.host_kv_gb, "disk_kv_dir": args.disk_kv_dir, "disk_kv_gb": args.disk_kv_gb,
             "host_kv_blocks": args.host_kv_blocks, "disk_kv_blocks": args.disk_kv_blocks}
    config = EngineConfig(
        model=model, served_name=args.served_name, dtype=args.dtype, device=args.device,
        block_size=args.block_size, num_kv_blocks=args.device_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, tp=args.tp,
        kv_memory_fraction=args.kv_memory_fraction, **gpu_execution_kwargs(args),
        grammar_backend=args.grammar_backend, grammar_threads=args.grammar_threads,
        grammar_spin_ms=args.grammar_spin_ms, **{k: v for k, v in tiers.items() if v is not None}, **lora_config(args),
    )
    check_loras(config, mc)
    return config


def check_loras(config, mc) -> None:
    """Read every --lora adapter once before anything starts: a broken directory is one line
    naming the file (LoraError), not a worker that dies after joining the mesh."""
    from engine.lora import read_adapter

    for name, path in config.loras:
        read_adapter(name, path, mc, config.model_name, config.max_lora_rank)


def mock_timing(settings: list[str]):
    """``FIELD=VALUE`` overrides of the mocker's ``TimingModel`` (numbers only)."""
    from dataclasses import fields, replace

    from mocker.engine import TimingModel

    base = TimingModel()
    types = {f.name: type(getattr(base, f.name)) for f in fields(TimingModel)}
    over = {}
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise CliError(f"--mock-timing {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(types)}")
        try:
            over[name] = types[name](value)
        except ValueError:
            raise CliError(f"--mock-timing {item!r}: {value!r} is not a number") from None
    try:
        return replace(base, **over)
    except ValueError as e:
        raise CliError(f"--mock-timing: {e}") from None


def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from mesh.config import settings
    from worker.base import WorkerSettings

    mock = args.mock or args.role == "mock"
    nats = nats_config(args, "prefill" if args.role == "prefill" else "decode")
    ws = WorkerSettings(
        nats_url=nats.url, nats=nats, ns=args.ns or settings().ns, worker_id=args.worker_id,
        engine=engine_config(args, mock=mock),
        transports=tuple(t for t in args.transports.split(",") if t),
        disagg_threshold=args.disagg_threshold, prefill_timeout=args.prefill_timeout,
        stream_interval_ms=args.stream_interval_ms,
        kv_event_interval_ms=args.kv_event_interval_ms,
        prefill_capacity=args.prefill_capacity, metrics_port=args.metrics_port, max_queued=args.max_queued,
        drain_timeout=args.drain_timeout, metrics_host=args.metrics_host,
        peer_fetch=args.peer_fetch and not mock and args.role == "decode", peer_fetch_timeout=args.peer_fetch_timeout,
    )
    if args.drain_timeout < 0:
        raise CliError("--drain-timeout must be >= 0")
    ws.transport_names()  # a bad transport list is a one-line error, not a dead worker
    if args.role == "prefill":
        from prefill.worker import PrefillWorker as cls
    elif mock:
        from mocker.worker import MockWorker as cls
    else:
        from decode.worker import DecodeWorker as cls
    worker = cls(ws)
    asyncio.run(worker.run())
    return worker.exit_code


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import asgi_app
    from gateway.serve import PortInUse, child_argv, default_workers, reuse_port_socket, supervise
    from gateway.service import Gateway, GatewayConfig
    from mesh.config import settings
    from mesh.router.policy import RouterConfig

    nats = nats_config(args, "gateway")
    auth = auth_config(args)
    models = args.model or ([settings().model] if settings().model else [])
    for m in models:
        if not Path(m).is_dir():
            raise CliError(f"model directory {m} does not exist")
    if args.max_inflight < 1 or args.first_token_timeout <= 0 or args.idle_timeout <= 0 or args.drain_timeout < 0:
        raise CliError("--max-inflight must be >= 1, the timeouts > 0 and --drain-timeout >= 0")
    workers = default_workers() if args.workers is None else args.workers
    if workers < 1:
        raise CliError("--workers must be >= 1")
    ns = args.ns or settings().ns
    if not args.reuse_port:  # the supervisor checked for its processes
        _preflight(nats, ns)  # unreachable, refused, no JetStream: one line here, not a traceback from uvicorn
    if workers > 1:
        try:
            return supervise(workers, child_argv(sys.argv[1:]), args.host, args.port)
        except PortInUse as e:
            raise CliError(str(e)) from None
    gw = Gateway(GatewayConfig(
        nats_url=nats.url, nats=nats, ns=ns, host=args.host, port=args.port,
        model_dirs=tuple(models), served_names=tuple(args.served_name), max_inflight=args.max_inflight,
        default_max_tokens=args.default_max_tokens, first_token_timeout=args.first_token_timeout,
        idle_timeout=args.idle_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        router=RouterConfig(mode=args.router, temperature=args.router_temperature, peer_fetch=args.router_peer_fetch,
                            **{k: v for k, v in (("prefill_weight", args.router_prefill_weight),
                                                 ("decode_weight", args.router_decode_weight)) if v is not None}),
    ))
    # on SIGTERM or SIGINT, open streams get --drain-timeout; then they are cancelled (which cancels
    # them on the workers)
    if not auth.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("mesh.gateway").warning(
            "no API keys: anyone who reaches %s:%d can use this gateway (--api-key-file, MESH_API_KEYS)",
            args.host, args.port)
    config = uvicorn.Config(asgi_app(gw, auth), host=args.host, port=args.port, loop="uvloop",
                            http="httptools", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout,
                            # longer than clients' idle pools keep connections (httpx: 5 s), so the
                            # server never closes one a client is about to reuse
                            timeout_keep_alive=75)
    sockets = [reuse_port_socket(args.host, args.port)] if args.reuse_port else None
    uvicorn.Server(config).run(sockets=sockets)
    return 0


def _preflight(nats, ns: str) -> None:
    """Join NATS once and leave: the errors of ``Bus.connect`` before a server starts."""
    import asyncio

    from mesh.bus import Bus

    async def check() -> None:
        bus = await Bus.connect(nats.url, "preflight", ns=ns, config=nats)
        await bus.nc.close()

    asyncio.run(check())


def cmd_up(args: argparse.Namespace) -> int:
    import asyncio

    from cli.up import UpPlan, default_model_dir, ensure_tiny_model, run_up

    if args.prefill < 0 or args.decode < 1:
        raise CliError("--decode must be >= 1 and --prefill >= 0")
    models: list[str] = []
    if not args.mock or args.model:  # --mock alone: the mocker under the name "mock", no tokenizer
        models = [str(m) for m in (args.model or [ensure_tiny_model(default_model_dir())])]
        names = [Path(m).name for m in models]
        if len(set(names)) != len(names):
            raise CliError(f"two --model directories share a name ({', '.join(names)}): models are named by directory")
        if args.served_name and len(models) > 1:
            raise CliError("--served-name names one model; with several --model each is named by its directory")
        for m in models:  # validates every model directory and the flags before anything starts
            args.model = m
            engine_config(args, mock=args.mock)
    flags = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--kv-memory-fraction", str(args.kv_memory_fraction)]
    if args.tp != 1:
        flags += ["--tp", str(args.tp)]
    flags += gpu_execution_flags(args)
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
    flags += ["--peer-fetch"] if args.peer_fetch else []
    gateway_flags = ["--served-name", args.served_name] if args.served_name and models else []
    if args.router:
        gateway_flags += ["--router", args.router]
    for name in ("router_temperature", "router_prefill_weight", "router_decode_weight", "tool_call_parser",
                 "reasoning_parser"):
        if getattr(args, name) is not None:
            gateway_flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    auth = auth_config(args)
    gateway_env = {"MESH_API_KEYS": ",".join(auth.keys)} if auth.keys else {}  # not on a command line
    if auth.admin_keys:
        gateway_env["MESH_ADMIN_API_KEYS"] = ",".join(auth.admin_keys)
    if auth.key_file:
        gateway_flags += ["--api-key-file", str(Path(auth.key_file).resolve())]
    for name in ("api_key_max_concurrent", "api_key_rpm"):
        if getattr(args, name):
            gateway_flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.metrics_auth:
        gateway_flags.append("--metrics-auth")
    if args.peer_fetch:
        gateway_flags += ["--router-peer-fetch"]
    if args.gateway_workers is not None:
        if args.gateway_workers < 1:
            raise CliError("--gateway-workers must be >= 1")
        gateway_flags += ["--workers", str(args.gateway_workers)]
    if args.min_prefill is None:
        args.min_prefill = min(1, args.prefill)
    planner = None if args.no_planner else planner_config(args)
    if planner is not None:  # start inside the planner's bounds
        args.prefill = min(max(args.prefill, planner.min_prefill), planner.max_prefill)
        args.decode = min(max(args.decode, planner.min_decode), planner.max_decode)
    nats = None
    if args.nats:
        nats = nats_config(args, "")
    elif any(getattr(args, f) for f in ("nats_creds", "nats_nkey", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")):
        raise CliError("--nats-creds, --nats-nkey and --nats-tls-* are for the servers of --nats; "
                       "the embedded server takes no credentials")
    elif args.js_replicas not in (None, 1):
        raise CliError("the embedded NATS is one server: --js-replicas above 1 needs --nats (a cluster)")
    plan = UpPlan(models=models, mock=args.mock, prefill=args.prefill, decode=args.decode, host=args.host,
                  port=args.port, nats=nats, ns=args.ns, worker_flags=flags,
                  gateway_flags=gateway_flags, planner=planner, served_name=args.served_name,
                  gateway_env=gateway_env)
    return asyncio.run(run_up(plan))


def cmd_planner(args: argparse.Namespace) -> int:
    import asyncio

    from mesh.config import settings

    nats = nats_config(args, "planner")
    config = planner_config(args)
    asyncio.run(_run_planner(nats, args.ns or settings().ns, args, config))
    return 0


async def _run_planner(nats, ns: str, args: argparse.Namespace, config) -> None:
    from mesh.bus import Bus
    from mesh.planner.connectors import KubernetesConnector, VirtualConnector
    from mesh.planner.planner import Planner
    from mesh.procutil import stop_event_on_signals
    from mesh.registry import Membership

    stop = stop_event_on_signals()
    if args.connector == "kubernetes":
        connector = KubernetesConnector(
            namespace=args.k8s_namespace, api=args.k8s_api,
            deployments={"prefill": args.prefill_deployment, "decode": args.decode_deployment},
        )
    else:
        connector = VirtualConnector({"prefill": config.min_prefill, "decode": config.min_decode})
    bus = await Bus.connect(nats.url, "planner", ns=ns, config=nats)
    membership = Membership(bus)
    await membership.start()
    planner = Planner(bus, membership, connector, config, model=args.model_name)
    await planner.start()
    try:
        await stop.wait()
    finally:
        await planner.stop()
        await membership.stop()
        await connector.close()
        await bus.close()


def cmd_top(args: argparse.Namespace) -> int:
    import asyncio

    from cli.top import run_top
    from mesh.config import settings

    nats = nats_config(args, "planner")  # it reads what the planner reads
    asyncio.run(run_top(nats, args.ns or settings().ns, args.interval, args.once))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mesh.config import settings

    logging.basicConfig(
        level=(args.log_level or settings().log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from mesh.errors import ModelError, RequestError

    try:
        return args.func(args)
    except (CliError, ModelError, RequestError, ValueError, OSError) as e:
        print(f"mesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The ``mesh`` console script: ``main``, then a quick exit (see ``procutil.exit_now``)."""
    code = main()
    from mesh.procutil import exit_now

    exit_now(code)


if __name__ == "__main__":
    entry()
