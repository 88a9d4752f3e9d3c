"""The ``mesh`` command: the top layer, which builds every role from its flags and runs it."""

from cli.main import CliError, build_parser, engine_config, entry, main

__all__ = ["CliError", "build_parser", "engine_config", "entry", "main"]
