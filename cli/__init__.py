"""The ``mesh`` command: the top layer, which builds every role from its flags and runs it."""

from cli.flags import CliError, engine_config
from cli.main import build_parser, entry, main

__all__ = ["CliError", "build_parser", "engine_config", "entry", "main"]
