"""``python -m bench engine-gpu``'s plumbing, on the CPU: ``--dry-run`` runs the GPU benchmark's code
with a tiny shape, so its arguments, mode switching, measurements and tables are exercised
without a GPU (the figures themselves mean nothing here)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.gpu import engine_gpu


def test_dry_run_prints_every_table_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    rc = engine_gpu.main(["--dry-run", "--gpu-batches", "1,4", "--gpu-profile", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out.read_text())
    assert json.loads(printed.strip().splitlines()[-1]) == obj  # the result object is the last line, too
    result = obj["figures"]
    rows = {(r["mode"], r["batch"]) for r in result["decode"]}
    assert rows == {("eager", 1), ("eager", 4), ("overlap", 1), ("overlap", 4)}
    for r in result["decode"]:  # the result object keeps six significant digits
        assert r["step_ms"] > 0 and r["tok_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3, rel=2e-5)
        assert r["roofline_ms"] > 0 and r["of_roofline"] == pytest.approx(r["roofline_ms"] / r["step_ms"], rel=2e-5)
    assert [p["prompt"] for p in result["prefill"]] == [64, 128] and all(p["tok_s"] > 0 for p in result["prefill"])
    # each mode's profile breaks a step down (on the CPU by operator: no kernel times), at batch 4 here
    assert [(q["mode"], q["batch"], q["device"]) for q in result["profiles"]] == [("eager", 4, "cpu"),
                                                                                ("overlap", 4, "cpu")]
    for q in result["profiles"]:
        assert q["wall_ms"] > 0 and 0 < len(q["top"]) <= 10 and q["kernel_ms"] is None
        assert sum(k["share"] for k in q["top"]) <= 1.0 and all(k["calls_per_step"] > 0 for k in q["top"])
    assert "profile: eager, batch 4, 2 decode steps" in printed
    assert "partial" not in obj  # the complete object replaced the partial ones written after each mode
    # modes this CPU cannot run are named, not silently dropped
    assert any(s.startswith("graphs:") for s in result["skipped"])
    assert "| batch | prompt | figure | eager | best mode | target |" in printed
    assert "prefill tok/s and TTFT (torch)" in printed and "DRY RUN" in printed


def test_the_profile_runs_at_batch_64_when_measured():
    assert engine_gpu.profile_batch([64, 1, 256]) == 64
    assert engine_gpu.profile_batch([1, 4, 8]) == 4


def test_decode_gaps_take_only_whole_batch_decode_steps():
    log = engine_gpu.StepLog.__new__(engine_gpu.StepLog)
    # (tokens scheduled, time): two prefill chunks, a mixed step, then decodes of a batch of 4
    log.entries = [(16, 1.0), (16, 2.0), (7, 3.0), (4, 3.5), (4, 4.0), (4, 4.6), (0, 4.7)]
    assert log.decode_gaps(4) == pytest.approx([0.5, 0.6])


def test_gpu_settings_parse_and_refuse_unknown_modes():
    p = argparse.ArgumentParser()
    engine_gpu.add_arguments(p)
    s = engine_gpu.gpu_settings(p.parse_args(["--gpu-modes", "eager,graphs+overlap", "--gpu-batches", "64,1"]))
    assert s.modes == ["eager", "graphs+overlap"] and s.batches == [64, 1] and s.prefill_lens == [2048, 8192]
    try:
        engine_gpu.gpu_settings(p.parse_args(["--gpu-modes", "warp"]))
    except SystemExit as e:
        assert "unknown --gpu-modes warp" in str(e)
    else:
        raise AssertionError("an unknown mode was accepted")
