"""``mesh gateway``: the OpenAI-compatible gateway, one process or several on one port."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cli.flags import (
    CliError,
    add_api_key_flags,
    add_batch_flags,
    add_bus_flags,
    add_parser_flags,
    auth_config,
    batch_config,
    hash_key,
    nats_config,
)
from mesh.natsauth import NatsConfig
from mesh.tokenlink import listen_address


def add_parser(sub) -> None:
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
    p.add_argument("--token-link", default="auto", metavar="auto|off|HOST[:PORT]",
                   help="where workers send this gateway's token batches over TCP instead of through NATS "
                        "(default auto: this host's address toward the NATS server, any free port; off "
                        "where the bus runs over TLS, as the link is plain TCP)")
    p.add_argument("--responses-ttl", type=float, default=None, metavar="SECONDS",
                   help="how long a stored response (/v1/responses) lives in the {ns}_responses bucket "
                        "(default: 30 days); the gateway that creates the bucket sets it")
    add_api_key_flags(p)
    add_batch_flags(p)
    p.add_argument("--insecure-admin", action="store_true",
                   help="without API keys, open the admin routes (LoRA load/unload) to every client "
                        "(default: closed until an admin key exists)")
    p.add_argument("--workers", type=int, default=None,
                   help="gateway processes on the port (SO_REUSEPORT; default: one per two cores, at most 4)")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers N
    add_parser_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import asgi_app
    from gateway.serve import PortInUse, child_argv, default_workers, reuse_port_socket, supervise
    from gateway.service import Gateway
    from mesh.config import settings

    nats = nats_config(args, "gateway")
    auth = auth_config(args)
    models = args.model or ([settings().model] if settings().model else [])
    for m in models:
        if not Path(m).is_dir():
            raise CliError(f"model directory {m} does not exist")
    if args.max_inflight < 1 or args.first_token_timeout <= 0 or args.idle_timeout <= 0 or args.drain_timeout < 0:
        raise CliError("--max-inflight must be >= 1, the timeouts > 0 and --drain-timeout >= 0")
    if args.responses_ttl is not None and args.responses_ttl <= 0:
        raise CliError("--responses-ttl must be > 0")
    if args.token_link not in ("auto", "off"):
        try:
            listen_address(args.token_link)
        except ValueError as e:
            raise CliError(str(e)) from None
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
    gw = Gateway(gateway_config(args, nats, ns, models))
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


def gateway_config(args: argparse.Namespace, nats: NatsConfig, ns: str, models: list[str]):
    """The ``GatewayConfig`` (and its ``RouterConfig``) of the flags above."""
    from gateway.service import GatewayConfig
    from mesh.router.policy import RouterConfig

    weights = (("prefill_weight", args.router_prefill_weight), ("decode_weight", args.router_decode_weight))
    return GatewayConfig(
        nats_url=nats.url, nats=nats, ns=ns, host=args.host, port=args.port,
        model_dirs=tuple(models), served_names=tuple(args.served_name), max_inflight=args.max_inflight,
        default_max_tokens=args.default_max_tokens, first_token_timeout=args.first_token_timeout,
        idle_timeout=args.idle_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, insecure_admin=args.insecure_admin, batch=batch_config(args),
        token_link=args.token_link,
        router=RouterConfig(mode=args.router, temperature=args.router_temperature, peer_fetch=args.router_peer_fetch,
                            hash_key=hash_key(args), **{k: v for k, v in weights if v is not None}),
        **({"responses_ttl": args.responses_ttl} if args.responses_ttl is not None else {}),
    )


def _preflight(nats: NatsConfig, ns: str) -> None:
    """Join NATS once and leave: the errors of ``Bus.connect`` before a server starts."""
    import asyncio

    from mesh.bus import Bus

    async def check() -> None:
        bus = await Bus.connect(nats.url, "preflight", ns=ns, config=nats)
        await bus.nc.close()

    asyncio.run(check())
