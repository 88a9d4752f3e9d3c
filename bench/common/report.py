"""The one JSON object every benchmark ends with: its figures, the machine and the commit.

``emit`` prints it as the last line of the benchmark's output (one line, so ``tail -1`` takes it)
and, with ``--json PATH``, writes it there too:

    {"benchmark": NAME, "command": "python -m bench NAME ...", "date": UTC, "figures": {...},
     "machine": {"cpu", "cores", "gpu", "python", "torch", "load_avg"},
     "commit": {"describe", "sha", "dirty"}}
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from bench.common.registry import ROOT, Benchmark

KEYS = ("benchmark", "command", "date", "figures", "machine", "commit")
MACHINE_KEYS = ("cpu", "cores", "gpu", "python", "torch", "load_avg")
COMMIT_KEYS = ("describe", "sha", "dirty")


def emit(bench: Benchmark, figures: dict, args) -> int:
    """Print the result object as the last line and write it to ``args.json`` if given; returns 0."""
    obj = result(bench, figures, getattr(args, "command", f"python -m bench {bench.name}"))
    line = json.dumps(obj, separators=(",", ":"))
    sys.stdout.flush()
    print(line, flush=True)
    if getattr(args, "json", None):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(obj, indent=2) + "\n")
    return 0


def result(bench: Benchmark, figures: dict, command: str) -> dict:
    return {
        "benchmark": bench.name,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "figures": plain(figures),
        "machine": machine(),
        "commit": commit(),
    }


def machine() -> dict:
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "gpu": _gpus(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "load_avg": round(os.getloadavg()[0], 2),
    }


def commit() -> dict:
    """``git describe --always --dirty``, the full sha, and whether tracked files differ from it."""
    def git(*a: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    describe = git("describe", "--always", "--dirty")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"describe": describe, "sha": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def plain(x):
    """``x`` as JSON can hold it: dataclasses as dicts, paths as strings, NaN and infinities as null,
    floats to six significant digits."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set):
        return [plain(v) for v in x]
    if isinstance(x, float):  # six significant digits: more than any figure here resolves
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, str | int | bool) or x is None:
        return x
    if hasattr(x, "item"):  # numpy and torch scalars
        return plain(x.item())
    return str(x)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str] | None:
    """The CUDA devices' names: from torch when this process has imported it, else nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        return names or None
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
