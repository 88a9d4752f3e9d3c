"""``mesh planner``: size the prefill and decode pools against TTFT and ITL targets."""

from __future__ import annotations

import argparse

from cli.flags import add_bus_flags, nats_config
from mesh.natsauth import NatsConfig
from mesh.planner.policy import PlannerConfig


def add_parser(sub) -> None:
    p = sub.add_parser("planner", help="size the prefill and decode pools against TTFT/ITL targets")
    add_bus_flags(p)
    PlannerConfig.add_args(p)
    p.add_argument("--connector", default="virtual", choices=["virtual", "kubernetes"],
                   help="kubernetes: scale the pool Deployments; virtual: publish decisions only")
    p.add_argument("--model-name", default=None, help="plan the pools of this served model (default: all workers)")
    p.add_argument("--k8s-namespace", default=None, help="default: the pod's namespace")
    p.add_argument("--prefill-deployment", default="pdmesh-prefill")
    p.add_argument("--decode-deployment", default="pdmesh-decode")
    p.add_argument("--k8s-api", default=None, help="default: the in-cluster API server")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from mesh.config import settings

    nats = nats_config(args, "planner")
    config = PlannerConfig.from_args(args)
    asyncio.run(_run_planner(nats, args.ns or settings().ns, args, config))
    return 0


async def _run_planner(nats: NatsConfig, ns: str, args: argparse.Namespace, config: PlannerConfig) -> None:
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
