"""Which benchmarks there are: each module declares itself once, ``BENCHMARK = Benchmark(...)``.

The entry point finds the declarations by reading the source of every module under ``bench/``
(``ast``, no import), so ``python -m bench --list`` costs no torch import and there is no second
list to keep in step by hand. A declaration's arguments must therefore be literals.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
AREAS = ("serving", "engine", "kv", "mesh", "gpu")  # the subpackages, in the order --list shows them


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``python -m bench NAME`` runs ``main(argv)`` of the module that declares it.

    ``smoke``: the arguments of its quick or dry run, which CI runs for every benchmark
    (``python -m bench --smoke``): arguments, imports, the setup it can do cheaply and the
    shape of its JSON object, in seconds. ``minutes``: about how long the default run takes on
    the 2-core development machine."""

    name: str
    measures: str
    minutes: float
    smoke: tuple[str, ...]
    target: str | None = None
    module: str = ""  # filled in by ``collect``

    @property
    def area(self) -> str:
        """Its folder (``collect`` knows it; a module's own ``BENCHMARK`` does not)."""
        return self.module.split(".")[1] if self.module else ""

    def line(self) -> str:
        """Its line in ``--list``."""
        took = f"~{self.minutes:g} min" if self.minutes >= 1 else f"~{self.minutes * 60:.0f} s"
        target = f" Target: {self.target}." if self.target else ""
        return f"{self.name:<15} {self.area:<8} {took:>8}  {self.measures}.{target}"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


@functools.cache
def collect() -> tuple[Benchmark, ...]:
    """Every declared benchmark, by area then name (read once per process)."""
    found = []
    for path in sorted(BENCH.glob("*/*.py")):
        area = path.parent.name
        if area not in AREAS:
            continue
        decl = _declaration(path)
        if decl is not None:
            found.append(Benchmark(**decl, module=f"bench.{area}.{path.stem}"))
    names = [b.name for b in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"benchmark names declared twice: {', '.join(sorted(dup))}")
    return tuple(sorted(found, key=lambda b: (AREAS.index(b.area), b.name)))


def find(name: str) -> Benchmark | None:
    name = name.replace("_", "-")
    return next((b for b in collect() if b.name == name), None)


def _declaration(path: Path) -> dict | None:
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["BENCHMARK"]
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "Benchmark"):
            try:
                decl = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
            except ValueError as e:
                raise RuntimeError(f"{path}: BENCHMARK's arguments must be literals ({e})") from None
            decl["smoke"] = tuple(decl.get("smoke", ()))
            return decl
    return None


def parser(bench: Benchmark, doc: str | None) -> argparse.ArgumentParser:
    """The benchmark's own parser: ``python -m bench NAME --help`` prints its module's docstring,
    and every benchmark takes ``--json PATH`` (its result object, also written there)."""
    p = argparse.ArgumentParser(prog=f"python -m bench {bench.name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the result object (the last line printed) here")
    return p


def parse(bench: Benchmark, p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)``, remembering the command that ran it for the result object."""
    args = p.parse_args(argv)
    args.command = " ".join(["python -m bench", bench.name, *map(shlex.quote, argv or [])])
    return args


DRY_RUN_HELP = ("the plumbing only: parse, import, build what would run and print it, end with the result "
                "object's shape (no processes, no measurement)")
