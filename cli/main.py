"""The ``mesh`` command line: one module per subcommand, put together here.

Each subcommand module adds its parser (``add_parser``) and runs it (``run``); what runs
is imported only when that subcommand does. Errors a user can fix print as one line and
exit non-zero.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cli import gateway, generate, model, planner, rank, top, up, worker
from cli.flags import CliError

SUBCOMMANDS = (model, generate, worker, rank, gateway, up, planner, top)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="pdmesh: disaggregated prefill/decode serving")
    parser.add_argument("--log-level", default=None, help="default: $MESH_LOG_LEVEL or WARNING")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


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
