"""The benchmark suite's plumbing: ``python -m bench`` lists every benchmark, and each one's quick
or dry run (``--smoke``: one process for all of them) parses its arguments, answers ``--help``,
imports, does the setup it can do cheaply and ends with a well-formed result object. No figure is
checked here: the figures are the benchmarks' own business (docs/benchmarks.md)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import registry, report
from bench.common.smoke import check

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_list_prints_one_line_per_benchmark_with_its_area_and_duration():
    out = bench("--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    declared = registry.collect()
    assert len(declared) >= 30 and len(lines) == len(declared)
    for b, line in zip(declared, lines, strict=True):
        name, area, took = line.split()[:3]
        assert (name, area) == (b.name, b.area) and took.startswith("~")
        assert b.measures[:40] in line and (b.target is None or b.target[:30] in line)


def test_every_module_with_a_main_is_a_declared_benchmark():
    """A benchmark is listed by its own declaration: one that runs (a ``main``) but is not declared
    would be missing from --list, the smoke run and the results page's check."""
    declared = {b.module for b in registry.collect()}
    for path in sorted((ROOT / "bench").glob("*/*.py")):
        if path.parent.name not in registry.AREAS:  # bench/common: the helpers
            continue
        tree = ast.parse(path.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        module = f"bench.{path.parent.name}.{path.stem}"
        assert has_main == (module in declared), f"{module}: a main() and no BENCHMARK, or the other way round"


def test_an_unknown_benchmark_is_one_line_and_a_non_zero_exit():
    out = bench("no-such-bench")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "no benchmark named 'no-such-bench'" in out.stderr


def test_the_result_check_names_what_is_missing():
    obj = report.result(registry.find("router"), {"x": 1}, "python -m bench router")
    assert check(obj, "router") == []
    del obj["machine"]["gpu"]
    obj["figures"] = {}
    assert check(obj, "router") == ["figures is not a non-empty object", "machine has no 'gpu'"]


@pytest.mark.timeout(600)
def test_every_benchmark_runs_its_smoke_mode_and_ends_with_its_result_object(tmp_path):
    out = bench("--smoke", "--report", str(tmp_path / "smoke.json"), timeout=540)
    outcomes = json.loads((tmp_path / "smoke.json").read_text())["outcomes"]
    failed = {o["name"]: (o["problems"], o.get("traceback", "")[-600:]) for o in outcomes if not o["ok"]}
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stdout[-3000:]}"
    assert [o["name"] for o in outcomes] == [b.name for b in registry.collect()]
    for o in outcomes:
        obj = o["result"]
        assert check(obj, o["name"]) == []
        assert obj["command"] == " ".join(["python -m bench", o["name"], *o["smoke"], "--json",
                                           str(Path(obj["command"].rsplit(" ", 1)[-1]))])
        assert isinstance(obj["machine"]["cores"], int) and obj["machine"]["python"] == sys.version.split()[0]
        assert obj["commit"]["sha"] is None or len(obj["commit"]["sha"]) == 40
