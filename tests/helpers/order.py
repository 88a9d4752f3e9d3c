"""The order the suite's modules start in: longest first, so that under pytest-xdist (whole
modules per process, handed out in this order) the short ones fill the end and both processes
finish together (longest processing time first).

A module's time comes from ``tests/module_durations.json`` (its path -> seconds, from a full run);
a module it does not list yet is taken as its layer's default (a new integration module is
probably long). Regenerate the file after a full run with a JUnit report::

    python -m pytest -q --junitxml /tmp/suite.xml && python -m tests.helpers.order /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "module_durations.json"
# seconds assumed for a module the file does not list: those that wait on real processes are long
LAYER_DEFAULT = {"integration": 30.0, "e2e": 20.0, "deploy": 10.0, "unit": 5.0, "gpu": 0.0}


def known_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def module_seconds(module: str, known: dict[str, float]) -> float:
    """``module``: its path from the root, ``tests/<layer>/test_x.py``."""
    if module in known:
        return known[module]
    parts = module.split("/")
    return LAYER_DEFAULT.get(parts[1] if len(parts) > 2 else "", 0.0)


def sort_items(items: list, known: dict[str, float]) -> None:
    """Longest module first; stable, so each module keeps its own order (and its fixtures' grouping)."""
    items.sort(key=lambda item: -module_seconds(item.nodeid.split("::", 1)[0], known))


def durations_from_junit(report: Path) -> dict[str, float]:
    """Each module's seconds (its tests' setup, call and teardown) from a JUnit XML report."""
    total: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        if not case.get("classname"):  # a module skipped whole (no CUDA) names none
            continue
        module = case.get("classname").split(".")
        # classname: tests.integration.test_x(.Class): the module is the part up to test_*
        end = next((i for i, p in enumerate(module) if p.startswith("test_")), len(module) - 1)
        total["/".join(module[:end + 1]) + ".py"] += float(case.get("time", 0))
    return {m: round(s, 1) for m, s in sorted(total.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.helpers.order JUNIT_XML")
    DURATIONS.write_text(json.dumps(durations_from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {DURATIONS}")
