"""docs/operations.md names every CLI flag, every MESH_* environment variable and every metric.

A flag, variable or metric added without a line in the operations reference fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "operations.md").read_text()
SOURCES = [p for pkg in ("mesh", "gateway", "decode", "prefill", "kvstore") for p in (ROOT / pkg).rglob("*.py")]


def mentioned(word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", DOC) is not None


def cli_options() -> list[tuple[str, str]]:
    out = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append((path, name))
                    walk(sub, f"{path} {name}".strip())
            else:
                out.extend((path, o) for o in action.option_strings if o.startswith("--") and o != "--help")

    walk(build_parser(), "mesh")
    return out


@pytest.mark.parametrize(("command", "option"), cli_options())
def test_every_subcommand_and_flag_is_documented(command, option):
    word = option if option.startswith("--") else f"{command} {option}"  # a flag, or `mesh model tiny`
    assert mentioned(word), f"`{command} {option}` is not in docs/operations.md"


def test_every_mesh_environment_variable_is_documented():
    names = {m for p in SOURCES for m in re.findall(r"\bMESH_[A-Z][A-Z0-9_]+", p.read_text())}
    assert {"MESH_NATS_URL", "MESH_NS", "MESH_MODEL", "MESH_LOG_LEVEL"} <= names
    assert not [n for n in sorted(names) if not mentioned(n)], "undocumented MESH_* variables"


def test_every_metric_is_documented():
    names = {m for p in SOURCES for m in re.findall(r"\bpdmesh_[a-z][a-z0-9_]*[a-z0-9]", p.read_text())}
    assert len(names) >= 20
    # prometheus_client adds _total to counters: either spelling counts
    missing = [n for n in sorted(names) if not (mentioned(n) or mentioned(f"{n}_total")
                                                 or mentioned(n.removesuffix("_total")))]
    assert not missing, f"metrics missing from docs/operations.md: {missing}"
