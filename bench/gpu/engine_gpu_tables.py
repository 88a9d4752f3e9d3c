"""``python -m bench engine-gpu``'s rows and tables: the modes' decode rows against the roofline,
the prefill rows, and the issue's table (eager, the baseline of the same run, beside the best mode)."""

from __future__ import annotations

import math
from dataclasses import dataclass

TARGET_ROOFLINE = 0.60  # the issue's target share of the HBM roofline for decode


@dataclass
class DecodeRow:
    mode: str
    batch: int
    prompt: int
    new_tokens: int
    step_ms: float
    tok_s: float
    roofline_ms: float
    of_roofline: float
    achieved_tb_s: float
    kernel_ms: float | None = None  # from the profile (one batch per mode)
    launches: float | None = None


@dataclass
class PrefillRow:
    attention: str
    batch: int
    prompt: int
    ttft_ms: float  # until every request has its first token
    mean_ttft_ms: float
    tok_s: float


def _cell(x: float | None, fmt: str) -> str:
    """``x`` formatted, or a dash in the same width when there is no figure."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return format("-", fmt.split(".")[0].rstrip("df") or ">")
    return format(x, fmt)


def print_report(header: str, decode: list[DecodeRow], prefill: list[PrefillRow], skipped: list[str], args) -> None:
    print(f"engine benchmark (GPU): {header}")
    print(f"decode: prompt {args.prompt}, {args.new_tokens} new tokens; ms/step = median gap between whole-batch "
          f"decode steps, best of {args.reps} runs; kernels = GPU kernel time per step (torch.profiler, "
          f"{args.gpu_profile} steps)")
    cols = (f"{'mode':<22}{'batch':>6}{'ms/step':>9}{'tok/s':>9}{'roofline ms':>12}{'of roofline':>12}"
            f"{'TB/s':>7}{'kernels ms':>11}{'host gap ms':>12}{'launches':>9}")
    print(cols)
    print("-" * len(cols))
    for r in decode:
        gap = None if r.kernel_ms is None else r.step_ms - r.kernel_ms
        print(f"{r.mode:<22}{r.batch:>6}{r.step_ms:>9.2f}{r.tok_s:>9.0f}{r.roofline_ms:>12.2f}{r.of_roofline:>12.0%}"
              f"{r.achieved_tb_s:>7.2f}{_cell(r.kernel_ms, '>11.2f')}{_cell(gap, '>12.2f')}"
              f"{_cell(r.launches, '>9.0f')}")
    print(f"\nprefill: batch {args.prefill_batch}, eager; TTFT = until every request has its first token")
    cols = f"{'attention':<22}{'prompt':>8}{'TTFT ms':>10}{'mean TTFT':>11}{'tok/s':>10}"
    print(cols)
    print("-" * len(cols))
    for p in prefill:
        print(f"{p.attention:<22}{p.prompt:>8}{p.ttft_ms:>10.1f}{p.mean_ttft_ms:>11.1f}{p.tok_s:>10.0f}")
    for s in skipped:
        print(f"not run: {s}")
    print_issue_table(decode, prefill)


def print_issue_table(decode: list[DecodeRow], prefill: list[PrefillRow]) -> None:
    """The issue's table: eager (the baseline of this run) and the best mode per batch."""
    print("\n| batch | prompt | figure | eager | best mode | target |")
    print("|---|---|---|---|---|---|")
    for batch in sorted({r.batch for r in decode}, key=lambda b: (b != 64, b)):
        rows = [r for r in decode if r.batch == batch]
        base = next((r for r in rows if r.mode == "eager"), None)
        best = min(rows, key=lambda r: r.step_ms)
        fig = "decode tok/s, % of roofline" if batch > 64 else "decode ms/step, % of roofline"
        verdict = "met" if best.of_roofline >= TARGET_ROOFLINE else "not met"
        print(f"| {batch} | {rows[0].prompt} | {fig} | {_decode_cell(base)} | {_decode_cell(best)} ({best.mode}) | "
              f">= {TARGET_ROOFLINE:.0%}: {verdict} |")
    if prefill:
        batch = prefill[0].batch
        for attention in dict.fromkeys(p.attention for p in prefill):
            mine = [p for p in prefill if p.attention == attention]
            cells = ", ".join(f"{_tokens(p.prompt)}: {p.tok_s:,.0f} tok/s, TTFT {p.ttft_ms:,.0f} ms" for p in mine)
            print(f"| {batch} | {' / '.join(_tokens(p.prompt) for p in mine)} | prefill tok/s and TTFT "
                  f"({attention}) | {cells} | | report |")


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _decode_cell(r: DecodeRow | None) -> str:
    if r is None:
        return "-"
    head = f"{r.tok_s:,.0f} tok/s" if r.batch > 64 else f"{r.step_ms:.2f} ms"
    return f"{head}, {r.of_roofline:.0%}"
