"""The layers (docs/architecture.md): the import contracts hold, and they catch a violation; no
import cycles, lazy ones included; production modules and functions stay small."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = CONFIG["root_packages"]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
SIZE_MARK = "# size:"  # a comment on the line above a def, saying why it may be longer


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Contracts: {len(CONFIG['contracts'])} kept, 0 broken." in r.stdout


@pytest.mark.parametrize(("importer", "line", "broken"), [
    ("kvstore/pool.py", "import mesh.protocol", "kvstore is not allowed to import mesh"),
    ("gateway/limits.py", "import torch", "gateway is not allowed to import torch"),
    ("mesh/bus.py", "import engine.core", "mesh is not allowed to import engine"),
    ("gateway/responses/routes.py", "import gateway.batches.store",
     "gateway.responses is not allowed to import gateway.batches"),
    ("gateway/outputs/detok.py", "import gateway.embeddings.routes",
     "gateway.outputs is not allowed to import gateway.embeddings"),
    ("worker/core.py", "import engine.core", "worker.core is not allowed to import engine"),
    ("mesh/registry.py", "import torch", "worker.core is not allowed to import torch"),
    ("worker/core.py", "import kvstore.pool", "worker.core is not allowed to import kvstore"),
])
def test_an_import_across_the_layers_breaks_a_contract(tmp_path, importer, line, broken):
    """The same check on a copy of the tree with one import added where the layers forbid it."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / importer).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    assert broken in r.stdout


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    imports = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(imports[node]):
                work.append((node, i + 1))
                nxt = imports[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_no_import_cycles_lazy_ones_included():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def production_modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_modules_and_functions_stay_small():
    too_big = []
    for path in production_modules():
        src = path.read_text()
        lines = src.splitlines()
        name = path.relative_to(ROOT)
        if len(lines) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and SIZE_MARK not in lines[first - 2]:
                too_big.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert too_big == []
