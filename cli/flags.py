"""What several subcommands share: the CLI's error, and the flag groups of NATS, the worker's
engine, API keys and output parsers.

Each config owns its flags (``add_args``) and their checks (``from_args``): ``NatsConfig``,
the engine's (``engine.flags``), the mocker's ``MockConfig``. This module puts them together
and turns a flag a config cannot take into a ``CliError``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import flags as engine_flags
from mesh.errors import ModelError
from mesh.natsauth import NatsConfig
from mocker.engine import MockConfig


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def add_bus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None,
                   help="NATS URL, or several comma-separated (a cluster); user:password@ or a token@ in "
                        "the URL authenticate (default: $MESH_NATS_URL, or an embedded server for mesh up)")
    p.add_argument("--ns", default=None, help="subject namespace (default: mesh)")
    p.add_argument("--hash-key-file", default=None, metavar="FILE",
                   help="the mesh's block-hash secret, 64 hex digits (mesh up writes one; default: "
                        "$MESH_HASH_KEY, else a public key: block hashes unkeyed)")
    NatsConfig.add_args(p)


def nats_config(args: argparse.Namespace, role: str, url: str | None = None) -> NatsConfig:
    """The process's one ``NatsConfig``: ``--nats`` and the ``--nats-*`` flags over ``MESH_NATS_*``."""
    from mesh.config import settings

    url = url or args.nats or settings().nats_url
    if not url:
        raise CliError("--nats URL is required (or MESH_NATS_URL)")
    return NatsConfig.from_args(args, url, role=role)


def hash_key(args: argparse.Namespace):
    """The process's block-hash secret: ``--hash-key-file``, else ``MESH_HASH_KEY``, else the public
    default (with one warning: prefixes are then forgeable by anyone who can send prompts)."""
    import logging

    from kvstore.hashing import DEFAULT_HASH_KEY, UNKEYED_WARNING, HashKey
    from mesh.config import settings

    try:
        if getattr(args, "hash_key_file", None):
            return HashKey.from_file(args.hash_key_file)
        if settings().hash_key:
            return HashKey.from_hex(settings().hash_key)
    except ValueError as e:
        raise CliError(f"{e} (--hash-key-file or MESH_HASH_KEY)") from None
    logging.getLogger("mesh").warning(UNKEYED_WARNING)
    return DEFAULT_HASH_KEY


def add_pool_flags(p: argparse.ArgumentParser, multi_model: bool = False) -> None:
    """The flags of a worker's engine, model or mocker (every role that runs one, and ``mesh up``)."""
    engine_flags.add_args(p, multi_model=multi_model)
    MockConfig.add_args(p)


def engine_config(args: argparse.Namespace, mock: bool = False):
    """The engine (``mock``: the mocker's) configuration from the pool flags. A flag it cannot take is
    a CliError; a model directory or adapter that cannot be served, a ModelError."""
    try:
        return MockConfig.from_args(args) if mock else engine_flags.from_args(args)
    except ModelError:
        raise
    except ValueError as e:
        raise CliError(str(e)) from None


def add_api_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY); repeatable; also $MESH_API_KEYS "
                        "(comma-separated). Prefer the file or the variable: a command line is visible to other users")
    p.add_argument("--admin-api-key", action="append", default=[], metavar="KEY",
                   help="a key that may also load and unload LoRA adapters (role admin); repeatable; also "
                        "$MESH_ADMIN_API_KEYS (comma-separated)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="keys, one per line: KEY [name=LABEL] [max_concurrent=N] [rpm=N] [role=admin] [tenant=NAME] "
                        "[cache_group=NAME] [max_priority=N] (docs/operations.md); reread "
                        "on SIGHUP and when it changes")
    p.add_argument("--api-key-max-concurrent", type=int, default=0, metavar="N",
                   help="requests in flight per key, for keys without their own (0: no limit); beyond: 429")
    p.add_argument("--api-key-rpm", type=int, default=0, metavar="N",
                   help="requests per minute per key, for keys without their own (0: no limit); beyond: 429")
    p.add_argument("--metrics-auth", action="store_true", help="/metrics needs an API key too (default: open)")


BATCH_FLAGS = (  # (flag, type, default, help): the Batch API's limits and pacing (gateway.limits.BatchConfig)
    ("--batch-max-files", int, 100, "batch input files one tenant may keep (beyond: 429)"),
    ("--batch-max-file-bytes", int, 200 << 20, "bytes of one uploaded file, and of a tenant's batch files in all"),
    ("--batch-max-queued-requests", int, 50_000, "lines of one tenant's unfinished batches (beyond: 429)"),
    ("--batch-max-inflight", int, 32, "batch lines one gateway runs at once, at most (the governor's ceiling)"),
    ("--batch-headroom", float, 0.25, "share of the decode workers' capacity batch lines leave free"),
    ("--batch-lease", float, 15.0, "seconds after which another gateway takes over a dead gateway's batches"),
)


def add_batch_flags(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in BATCH_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")


def batch_flags(args: argparse.Namespace) -> list[str]:
    """The batch flags that differ from their defaults, as a command line (``mesh up`` -> gateway)."""
    out = []
    for flag, _, default, _ in BATCH_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value != default:
            out += [flag, str(value)]
    return out


def batch_config(args: argparse.Namespace):
    """The gateway's ``BatchConfig`` from ``add_batch_flags`` (a bad value: one line now)."""
    from gateway.limits import BatchConfig

    try:
        return BatchConfig(max_files=args.batch_max_files, max_file_bytes=args.batch_max_file_bytes,
                           max_queued_requests=args.batch_max_queued_requests, max_inflight=args.batch_max_inflight,
                           headroom=args.batch_headroom, lease_s=args.batch_lease)
    except ValueError as e:
        raise CliError(str(e)) from None


def auth_config(args: argparse.Namespace):
    """The gateway's ``AuthConfig`` from ``add_api_key_flags`` and ``MESH_*API_KEYS`` (a key file
    that does not parse: one line now)."""
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

        KeyRing(auth)
    return auth


def add_parser_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's output parsers, when a model's chat template does not show its formats."""
    from gateway.outputs.reasoning import REASONING_FORMATS
    from gateway.outputs.tools import TOOL_FORMATS

    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_FORMATS),
                   help="the tool-call format of every model (default: found in each chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=["none", *sorted(REASONING_FORMATS)],
                   help="the reasoning format of every model, or none (default: found in each chat template)")
