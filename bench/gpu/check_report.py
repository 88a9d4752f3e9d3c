"""The GPU check's one JSON of results, from what its steps left behind.

``bench/gpu_check.sh`` runs each step under a time limit and appends a line to
``WORK/steps.tsv`` (name, exit status, seconds, limit, command), with the step's output in
``WORK/steps/NAME.out``; the pytest steps write junit XML and the benchmarks their result
objects. After each part it runs

    python -m bench.gpu.check_report WORK OUT/gpu_check.json [--dry-run]

which writes, per part (in the check's order: engine, tests, transfer, moe), its status
(passed, failed, timed_out, no_time, not_run), seconds, commands, figures or the failures named,
plus the setup (machine, install, the carried kernels). Written after every part, so a check cut
off from outside still brings back the parts before. Python's standard library only: it runs
before anything is installed, and in CI.
"""

from __future__ import annotations

import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# part -> its steps, in the order they run
PARTS = {
    "engine": ("bench-engine",),
    "tests": ("gpu-tests",),
    "transfer": ("bench-transfer-gpu", "transfer-tests", "gpu-marked-elsewhere"),
    "moe": ("moe-build-wait", "moe-tests"),
}
SETUP = ("machine", "install", "kernels")
# the files each part's figures or test results come from (names under OUT)
ARTIFACTS = {
    "bench-engine": "bench_engine_gpu.json",
    "bench-transfer-gpu": "bench_transfer_gpu.json",
    "gpu-tests": "gpu_tests.xml",
    "transfer-tests": "gpu_transfer_tests.xml",
    "moe-tests": "gpu_tests_moe.xml",
}
NOT_ASKED = {"moe": "opt-in (GPU_CHECK_PARTS=moe): FlashInfer's fused MoE module for sm_90 is 182 CUTLASS "
                  "sources, more nvcc than a lease holds, and too large to carry"}
RANK = {"passed": 0, "not_run": 1, "no_time": 2, "timed_out": 3, "failed": 4}
VERBOSE_LINE = re.compile(r"^(tests/\S+::\S+(?:\[[^\]]*\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def read_steps(work: Path) -> dict[str, dict]:
    steps = {}
    path = work / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        name, rc, seconds, limit, command = (line.split("\t") + [""] * 5)[:5]
        steps[name] = {"rc": None if rc == "-" else int(rc), "seconds": int(seconds), "limit": int(limit),
                       "command": command}
    return steps


def status_of(step: dict) -> str:
    if step["rc"] is None:
        return "no_time"
    if step["rc"] == 0:
        return "passed"
    return "timed_out" if step["rc"] in (124, 137) else "failed"


def tail(path: Path, lines: int = 3) -> str:
    if not path.exists():
        return ""
    text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("== ")]
    return " | ".join(text[-lines:])[-600:]


def junit(path: Path) -> dict | None:
    """Counts and the failed tests (name and first line of the message) of a junit XML."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable junit XML: {e}"}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, slowest = [], []
    for case in root.iter("testcase"):
        classname = case.get("classname") or ""
        name = f"{classname}::{case.get('name')}" if classname else case.get("name", "")
        seconds = float(case.get("time") or 0)
        slowest.append((seconds, name))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": name, "message": (message[0] if message else "")[:400]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    slowest.sort(reverse=True)
    return {"counts": counts, "failures": failures,
            "slowest": [{"test": n, "seconds": round(s, 1)} for s, n in slowest[:5]]}


def from_verbose_log(path: Path) -> dict | None:
    """The same from pytest -v's lines, for a run cut off before it wrote its XML."""
    if not path.exists():
        return None
    results = VERBOSE_LINE.findall(path.read_text(errors="replace"))
    if not results:
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped"}
    for _, outcome in results:
        counts[key[outcome]] += 1
    return {"counts": counts, "failures": [{"test": t, "message": "(cut off before its report: see the log)"}
                                           for t, o in results if o in ("FAILED", "ERROR")],
            "from": "pytest -v lines (no junit XML: the run was cut off)"}


def figures(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return {"error": f"unreadable result object: {e}"}
    out = obj.get("figures", obj)
    if obj.get("partial"):
        out = {**out, "partial": True}
    return out


def step_report(name: str, step: dict | None, work: Path, out: Path) -> dict:
    if step is None:
        return {"step": name, "status": "not_run"}
    report = {"step": name, "status": status_of(step), "seconds": step["seconds"], "limit": step["limit"],
              "command": step["command"]}
    artifact = ARTIFACTS.get(name)
    if artifact and artifact.endswith(".xml"):
        tests = junit(out / artifact) or from_verbose_log(work / "steps" / f"{name}.out")
        if tests:
            report["tests"] = tests
    elif artifact:
        found = figures(out / artifact)
        if found is not None:
            report["figures"] = found
    if report["status"] != "passed":
        report["failure"] = failure_text(name, report, work)
    return report


def failure_text(name: str, report: dict, work: Path) -> str:
    if report["status"] == "no_time":
        return f"{name}: skipped, the check's deadline left too little time"
    named = report.get("tests", {}).get("failures")
    if named:
        return "; ".join(f"{f['test']}: {f['message']}" for f in named[:5])
    what = "timed out after its limit" if report["status"] == "timed_out" else "failed"
    return f"{name} {what}: {tail(work / 'steps' / f'{name}.out')}"


def headline(steps: list[dict]) -> str:
    """One line a reader takes in at a glance: the engine's batch-64 figures, the tests' counts."""
    said = []
    for step in steps:
        decode = (step.get("figures") or {}).get("decode") or []
        if decode:
            batch = 64 if any(r["batch"] == 64 for r in decode) else max(r["batch"] for r in decode)
            rows = [r for r in decode if r["batch"] == batch]
            best, eager = min(rows, key=lambda r: r["step_ms"]), next((r for r in rows if r["mode"] == "eager"), None)
            base = f"eager {eager['step_ms']:.2f} ms ({eager['of_roofline']:.0%}), " if eager else ""
            said.append(f"batch {batch}: {base}best {best['mode']} {best['step_ms']:.2f} ms "
                        f"({best['of_roofline']:.0%} of the roofline)")
        transfer = (step.get("figures") or {}).get("rows")
        if transfer is not None:
            said.append(f"{step['step']}: {len(transfer)} rows, failed: {step['figures'].get('failed') or 'none'}")
        counts = (step.get("tests") or {}).get("counts")
        if counts:
            said.append(f"{step['step']}: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    return "; ".join(said)


def part_report(steps: list[dict]) -> dict:
    ran = [s for s in steps if s["status"] != "not_run"]
    status = max((s["status"] for s in ran), key=RANK.get) if ran else "not_run"
    part = {"status": status, "seconds": sum(s.get("seconds", 0) for s in steps), "headline": headline(steps),
            "steps": steps}
    failures = [s["failure"] for s in steps if "failure" in s]
    if failures:
        part["failure"] = " || ".join(failures)
    return part


def kernels_report(work: Path, workspace: str | None) -> dict:
    out = {}
    if workspace:  # what FlashInfer compiled here, in this call or an earlier one on this warm machine
        out["built_on_device"] = sorted(so.stem for so in Path(workspace).glob(".cache/flashinfer/*/*/cached_ops/*/*.so"))
    for name, file in (("carried", "kernels_verify.json"), ("device_build", "kernels_build.json")):
        path = work / file
        if path.exists():
            try:
                out[name] = json.loads(path.read_text().strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError) as e:
                out[name] = {"error": f"unreadable: {e}"}
    return out


def build(work: Path, out: Path, dry_run: bool) -> dict:
    steps = read_steps(work)
    meta = json.loads((work / "meta.json").read_text()) if (work / "meta.json").exists() else {}
    setup = {name: step_report(name, steps.get(name), work, out) for name in SETUP}
    setup["kernels"]["modules"] = kernels_report(work, meta.get("flashinfer_workspace"))
    parts = {}
    for part, names in PARTS.items():
        if part not in meta.get("parts_asked", PARTS):
            parts[part] = {"status": "not_run", "seconds": 0, "steps": [],
                           "note": NOT_ASKED.get(part, "not asked for (GPU_CHECK_PARTS)")}
            continue
        parts[part] = part_report([step_report(n, steps.get(n), work, out) for n in names])
    summary = ", ".join(f"{p} {r['status']}" for p, r in parts.items())
    ok = all(r["status"] in ("passed", "not_run") for r in parts.values()) and any(
        r["status"] == "passed" for r in parts.values())
    return {"check": "bench/gpu_check.sh", "dry_run": dry_run, "ok": ok, "summary": summary, **meta,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": sorted(f.name for f in out.iterdir()),
            "setup": setup, "parts": parts}


def cli(argv: list[str]) -> int:  # not ``main``: that names a benchmark (bench/common/registry.py)
    if len(argv) < 2:
        print("usage: python -m bench.gpu.check_report WORK OUT_JSON [--dry-run]", file=sys.stderr)
        return 2
    work, target = Path(argv[0]), Path(argv[1])
    report = build(work, target.parent, "--dry-run" in argv[2:])
    target.write_text(json.dumps(report, indent=1) + "\n")
    print(f"results: {report['summary']} ({target})")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
