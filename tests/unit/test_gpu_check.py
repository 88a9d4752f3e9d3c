"""``bench/gpu_check.sh``, the check a lent GPU machine runs, proved on the CPU so that a device
never meets a broken script: its dry run goes through every part's real command in its dry mode
(imports, arguments, the benchmarks' dry runs, tests/gpu collected and skipping), reads and
checks a carried-kernel manifest, and writes the results JSON in its real shape. The results'
reader is checked on its own against a run cut off mid-way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import check_report
from bench.gpu import flashinfer_modules as fm

ROOT = Path(__file__).resolve().parents[2]


def fake_carry(root: Path) -> Path:
    """A carried folder with two modules: one intact, one whose bytes changed on the way."""
    carry = root / "gpu_kernels"
    entries = []
    for key, payload in (("norm", b"\x7fELF a norm module"), ("rope", b"\x7fELF a rope module")):
        rel = Path("jit_cache") / key / f"{key}.so"
        (carry / rel).parent.mkdir(parents=True)
        (carry / rel).write_bytes(payload)
        entries.append({"key": key, "name": key, "file": str(rel), "bytes": len(payload),
                        "sha256": fm.sha256(carry / rel)})
    (carry / entries[1]["file"]).write_bytes(b"\x7fELF a rope module, corrupt")
    entries[1]["bytes"] = (carry / entries[1]["file"]).stat().st_size
    fm.write_finder(carry)
    (carry / "manifest.json").write_text(json.dumps({"toolchain": {"nvcc": "test"}, "modules": entries}))
    return carry


def run_check(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
                "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer"), **env}
    return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=600)


def test_the_dry_run_runs_every_part_and_writes_the_results_in_their_real_shape(tmp_path):
    carry = fake_carry(tmp_path)
    done = run_check(tmp_path, "--dry-run", GPU_KERNELS_DIR=str(carry), GPU_BENCH_ARGS="--reps 1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_check.json", "gpu_check.log"} <= set(files)  # what the device tool returns
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] and result["ok"] and result["parts_asked"] == ["engine", "tests", "transfer"]
    assert list(result["parts"]) == ["engine", "tests", "transfer", "moe"]  # in the order of their value
    assert result["parts"]["moe"]["status"] == "not_run" and "opt-in" in result["parts"]["moe"]["note"]

    engine = result["parts"]["engine"]
    assert engine["status"] == "passed" and engine["seconds"] >= 0
    (bench,) = engine["steps"]
    assert "engine-gpu --dry-run --gpu-batches 64,1,256" in bench["command"] and "--reps 1" in bench["command"]
    assert {r["mode"] for r in bench["figures"]["decode"]} == {"eager", "overlap"}
    assert [p["mode"] for p in bench["figures"]["profiles"]] == ["eager", "overlap"]

    assert engine["headline"].startswith("batch 8: eager ") and "of the roofline" in engine["headline"]
    (tests,) = result["parts"]["tests"]["steps"]
    assert "--ignore=tests/gpu/test_moe_gpu.py" in tests["command"] and "--junitxml" in tests["command"]
    assert tests["tests"]["counts"]["skipped"] >= 4 and tests["tests"]["counts"]["failed"] == 0  # no CUDA here
    transfer = {s["step"]: s for s in result["parts"]["transfer"]["steps"]}
    assert list(transfer) == ["bench-transfer-gpu", "transfer-tests", "gpu-marked-elsewhere"]
    assert all(s["status"] == "passed" for s in transfer.values())
    assert "figures" in transfer["bench-transfer-gpu"]

    assert result["setup"]["kernels"]["modules"]["built_on_device"] == []  # a dry run builds nothing
    kernels = result["setup"]["kernels"]["modules"]["carried"]
    assert kernels["carried"] == ["norm", "rope"] and "sha256" in kernels["failed"]["rope"]
    assert "norm" not in kernels["failed"] and "attention:bfloat16-128" in kernels["not_carried"]
    log = (out / "gpu_check.log").read_text()
    assert "kernels-build (background; not in a dry run)" in log and "--modules attention:bfloat16-128," in log


@pytest.mark.parametrize("args,env,message", [
    (["--fast"], {}, "unknown argument --fast"),
    (["--dry-run"], {"GPU_CHECK_PARTS": "engine warp"}, "unknown part warp"),
])
def test_bad_arguments_are_one_line_and_a_non_zero_exit(tmp_path, args, env, message):
    done = run_check(tmp_path, *args, **env)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_deadline_below_the_parts_minimums_runs_nothing_and_says_so(tmp_path):
    # 100 s cannot hold the setup plus the minimum every part keeps: no step starts, the JSON says why
    done = run_check(tmp_path, "--dry-run", GPU_CHECK_SECONDS="100")
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert done.returncode == 1 and not result["ok"]
    assert result["setup"]["install"]["status"] == "no_time"
    assert "deadline" in result["setup"]["install"]["failure"]
    assert all(p["status"] == "not_run" for p in result["parts"].values())


def test_a_part_cut_off_names_its_tests_from_the_verbose_lines(tmp_path):
    # a tests step killed by its time limit: no junit XML, only pytest -v's lines in its output
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "steps").mkdir(parents=True)
    out.mkdir()
    (work / "meta.json").write_text(json.dumps({"parts_asked": ["engine", "tests", "transfer"]}))
    (work / "steps.tsv").write_text("bench-engine\t1\t40\t260\tpython -m bench engine-gpu\n"
                                    "gpu-tests\t124\t200\t200\tpytest tests/gpu\n"
                                    "transfer-tests\t-\t0\t0\tpytest tests/gpu/test_transfer_gpu.py\n")
    (work / "steps" / "bench-engine.out").write_text("loading\nRuntimeError: CUDA out of memory\n")
    (work / "steps" / "gpu-tests.out").write_text(
        "tests/gpu/test_flashinfer.py::test_a[bfloat16] PASSED [  1%]\n"
        "tests/gpu/test_graphs_overlap.py::test_b FAILED [  2%]\n"
        "tests/gpu/test_graphs_overlap.py::test_c ")
    result = check_report.build(work, out, dry_run=False)
    engine, tests, transfer = (result["parts"][p] for p in ("engine", "tests", "transfer"))
    assert engine["status"] == "failed" and "CUDA out of memory" in engine["failure"]
    assert tests["status"] == "timed_out"
    assert tests["steps"][0]["tests"]["counts"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 0}
    assert "tests/gpu/test_graphs_overlap.py::test_b" in tests["failure"]
    assert tests["headline"] == "gpu-tests: 1 passed, 1 failed"
    assert transfer["status"] == "no_time" and "deadline" in transfer["failure"]
    assert not result["ok"] and result["summary"] == "engine failed, tests timed_out, transfer no_time, moe not_run"


def test_the_module_list_selects_what_the_check_carries():
    assert [m.key for m in fm.select("first")] == ["attention:bfloat16-128", "norm", "activation:silu", "rope",
                                                    "cascade"]
    assert "fused_moe:sm90" not in {m.key for m in fm.select("carried")}
    with pytest.raises(ValueError, match="unknown kernel module"):
        fm.select("norm,warp")
