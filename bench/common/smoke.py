"""Every benchmark's smoke run (its declared ``smoke`` arguments) in this one process.

What it proves for each: its arguments parse (``--help`` too), its modules import, the setup it can
do cheaply runs, and it ends with a well-formed result object, printed last and written by
``--json``. It proves no figure. ``python -m bench --smoke [NAME ...] [--report PATH]``: one line
per benchmark, and with ``--report`` the outcomes as JSON (what the CI test reads).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import registry, report


def check(obj: dict, name: str) -> list[str]:
    """What is wrong with a result object (empty: nothing)."""
    bad = [f"no {k!r}" for k in report.KEYS if k not in obj]
    if bad:
        return bad
    if obj["benchmark"] != name:
        bad.append(f"benchmark is {obj['benchmark']!r}")
    if not isinstance(obj["figures"], dict) or not obj["figures"]:
        bad.append("figures is not a non-empty object")
    bad += [f"machine has no {k!r}" for k in report.MACHINE_KEYS if k not in obj["machine"]]
    bad += [f"commit has no {k!r}" for k in report.COMMIT_KEYS if k not in obj["commit"]]
    if not str(obj["command"]).startswith(f"python -m bench {name}"):
        bad.append(f"command is {obj['command']!r}")
    return bad


def run_one(bench: registry.Benchmark, out_dir: Path) -> dict:
    t0 = time.monotonic()
    out, err = io.StringIO(), io.StringIO()
    path = out_dir / f"{bench.name}.json"
    outcome = {"name": bench.name, "smoke": list(bench.smoke), "ok": False, "problems": []}
    threads = _torch_threads()
    try:
        module = bench.load()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                module.main(["--help"])
            except SystemExit as e:
                if e.code not in (0, None):
                    outcome["problems"].append(f"--help exited {e.code}")
            if f"python -m bench {bench.name}" not in out.getvalue():
                outcome["problems"].append("--help does not name the command")
            out.seek(0)
            out.truncate()
            rc = module.main([*bench.smoke, "--json", str(path)])
        if rc:
            outcome["problems"].append(f"exit code {rc}")
        lines = out.getvalue().strip().splitlines()
        printed = json.loads(lines[-1]) if lines else None
        if printed is None:
            outcome["problems"].append("printed nothing")
        else:
            outcome["problems"] += check(printed, bench.name)
            if not path.is_file() or json.loads(path.read_text()) != printed:
                outcome["problems"].append("--json did not write the printed object")
            outcome["result"] = printed
    except BaseException as e:  # a benchmark's failure of any kind is this run's finding
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome["problems"].append(f"{type(e).__name__}: {e}")
        outcome["traceback"] = traceback.format_exc()[-3000:]
    finally:
        _torch_threads(threads)
    outcome["ok"] = not outcome["problems"]
    outcome["seconds"] = round(time.monotonic() - t0, 2)
    if not outcome["ok"]:
        outcome["output_tail"] = (out.getvalue()[-2000:], err.getvalue()[-2000:])
    return outcome


def main(argv: list[str]) -> int:
    report_path = None
    if "--report" in argv:
        i = argv.index("--report")
        report_path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    benches = registry.collect()
    unknown = set(argv) - {b.name for b in benches}
    if unknown:
        print(f"python -m bench --smoke: no benchmark named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    chosen = [b for b in benches if not argv or b.name in argv]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' threads would warn after a fork
    t0 = time.monotonic()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-smoke-") as tmp:
        for b in chosen:
            o = run_one(b, Path(tmp))
            outcomes.append(o)
            print(f"{'ok  ' if o['ok'] else 'FAIL'} {b.name:<15} {o['seconds']:6.2f} s  "
                  f"python -m bench {b.name} {' '.join(b.smoke)}" + ("" if o["ok"] else f"  {o['problems']}"),
                  flush=True)
            if not o["ok"] and o.get("traceback"):
                print(o["traceback"], file=sys.stderr)
    total = time.monotonic() - t0
    failed = [o["name"] for o in outcomes if not o["ok"]]
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} benchmarks ran their smoke mode in {total:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    if report_path:
        Path(report_path).write_text(json.dumps({"seconds": round(total, 2), "outcomes": outcomes}, indent=1))
    return 1 if failed else 0


def _torch_threads(n: int | None = None) -> int | None:
    """torch's thread count (set it back to ``n``): a benchmark may change it for the whole process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()

