"""The figures of ``python -m bench trace-replay``: per-run summaries, reuse attribution, tables, the TTFT plot.

Reuse of prompt tokens, per run (fractions of the prompt tokens of the requests that completed):

* available: the oracle, one unlimited cache shared by all workers (what any placement could reuse);
* captured by routing: what the router's decisions made reachable: each request's reusable run on
  the chosen worker (any tier, or still being prefilled there: "predicted") plus the blocks it
  planned to fetch from a peer, as published on ``router.decisions``;
* delivered: what the engines reused (``usage.prompt_tokens_details.cached_tokens``);
* by source: where the delivered blocks came from, from the workers' load-report counters
  (``hit_blocks_device|host|disk|peer``, blocks x 16 tokens).
"""

from __future__ import annotations

from pathlib import Path

BLOCK_SIZE = 16
SOURCES = ("device", "host", "disk", "peer")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def tpot(r) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
    if r.e2e is None or r.ttft is None or r.completion_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.completion_tokens - 1)


def summarize(results: list, run: dict) -> dict:
    ok = [r for r in results if r.error is None and r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    lags = [r.lag for r in results]
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "oracle_hit_rate": sum(r.oracle_cached for r in ok) / prompt if prompt else 0.0,
        "ttft_p50": pct([r.ttft for r in ok], 0.5),
        "ttft_p90": pct([r.ttft for r in ok], 0.9),
        "ttft_p99": pct([r.ttft for r in ok], 0.99),
        "tpot_p50": pct(tpots, 0.5),
        "tpot_p99": pct(tpots, 0.99),
        "e2e_p50": pct([r.e2e for r in ok], 0.5),
        "e2e_p99": pct([r.e2e for r in ok], 0.99),
        "lag_p50": pct(lags, 0.5),
        "lag_p99": pct(lags, 0.99),
        "lag_max": max(lags, default=0.0),
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / run["wall_s"],
        **run,
    }


def balance(results: list, loads: list[tuple]) -> dict:
    """How evenly the work spread: request shares per worker, and pending prefill on the busiest worker."""
    out: dict = {}
    per_worker: dict[str, int] = {}
    for r in results:
        if r.worker:
            per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    if per_worker:
        out["busiest_worker_share"] = max(per_worker.values()) / sum(per_worker.values())
        out["credited_overlap_tokens"] = sum(r.overlap_blocks for r in results) * BLOCK_SIZE
    latest: dict[int, dict[str, int]] = {}  # second -> worker -> pending prefill tokens
    for t, worker, _waiting, _running, pending, *_ in loads:
        latest.setdefault(int(t), {})[worker] = pending
    peaks = [max(v.values()) for v in latest.values() if v]
    means = [sum(v.values()) / len(v) for v in latest.values() if v]
    if peaks:
        out["pending_prefill_peak_p50"] = pct(peaks, 0.5)
        out["pending_prefill_peak_max"] = max(peaks)
        out["pending_prefill_mean"] = sum(means) / len(means)
    return out


def attribution(results: list, counters: dict[str, dict[str, int]]) -> dict:
    """Reuse available / captured by routing / delivered, and delivered by source (see the module doc).

    ``counters``: each worker's latest load-report counters (they count from the worker's start;
    every run starts fresh workers)."""
    ok = [r for r in results if r.error is None and r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    if not prompt:
        return {}
    out = {"reuse_available": sum(r.oracle_cached for r in ok) / prompt,
           "reuse_delivered": sum(r.cached_tokens for r in ok) / prompt}
    if any(r.worker for r in ok):
        captured = sum(min(r.hit_blocks + r.fetch_blocks, max((r.prompt_tokens - 1) // BLOCK_SIZE, 0))
                       for r in ok) * BLOCK_SIZE
        out["reuse_captured"] = captured / prompt
        out["planned_fetches"] = sum(1 for r in ok if r.fetch_blocks)
    if counters:
        total = {s: sum(c.get(f"hit_blocks_{s}", 0) for c in counters.values()) for s in SOURCES}
        for s, blocks in total.items():
            out[f"reuse_{s}"] = blocks * BLOCK_SIZE / prompt
        for key in ("peer_fetch_requests", "peer_fetch_ok", "peer_fetch_failed", "peer_fetch_blocks",
                    "peer_serve_blocks", "fetch_pins_expired", "preemptions"):
            out[key] = sum(c.get(key, 0) for c in counters.values())
    return out


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:,.0f} ms" if v < 10 else f"{v:,.1f} s"


def _pc(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def table(phase: str, speedup: float, summaries: dict[str, dict]) -> str:
    rows = [f"{phase} (mock speedup {speedup:g}):",
            "| mode | hit rate | oracle | TTFT p50 | TTFT p99 | TPOT p50 | E2E p50 | busiest | errors | send lag p99 "
            "| CPU client / others |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summaries.items():
        rows.append(f"| {mode} | {_pc(s['hit_rate'])} | {_pc(s['oracle_hit_rate'])} | "
                    f"{_ms(s['ttft_p50'])} | {_ms(s['ttft_p99'])} | {_ms(s.get('tpot_p50'))} | {_ms(s['e2e_p50'])} | "
                    f"{_pc(s.get('busiest_worker_share'))} | {s['errors']}/{s['requests']} | {_ms(s['lag_p99'])} | "
                    f"{s['client_cpu_cores']:.2f} / {s['other_cpu_cores']:.2f} |")
    return "\n".join(rows)


def reuse_table(phase: str, summaries: dict[str, dict]) -> str:
    rows = [f"{phase}: reuse of prompt tokens",
            "| mode | available (oracle) | captured by routing | delivered | device | host | disk | peer "
            "| fetches ok / failed | pins expired |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summaries.items():
        rows.append(f"| {mode} | {_pc(s.get('reuse_available'))} | {_pc(s.get('reuse_captured'))} | "
                    f"{_pc(s.get('reuse_delivered'))} | " + " | ".join(_pc(s.get(f"reuse_{x}")) for x in SOURCES)
                    + f" | {s.get('peer_fetch_ok', 0)} / {s.get('peer_fetch_failed', 0)} | "
                    f"{s.get('fetch_pins_expired', 0)} |")
    return "\n".join(rows)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def issue_table(phases: dict[str, dict[str, dict]], baseline: str = "round-robin") -> str:
    """Issue 20's table: every mode against the round-robin run of the same invocation."""
    modes = list(dict.fromkeys(m for s in phases.values() for m in s))
    free, loaded = phases.get("free", {}), phases.get("loaded", {})
    rr = loaded.get(baseline, {})

    def row(figure: str, cell, target: str) -> str:
        return f"| {figure} | " + " | ".join(cell(m) for m in modes) + f" | {target} |"

    def vs_rr(key: str):
        return lambda m: _ratio(loaded.get(m, {}).get(key), rr.get(key)) if m in loaded and rr else "-"

    rows = ["| figure | " + " | ".join(modes) + " | target |", "|---|" + "---|" * (len(modes) + 1),
            row("reuse of prompt blocks, free phase", lambda m: _pc(free.get(m, {}).get("hit_rate")), ">= 50%"),
            row("loaded TTFT p50 vs round-robin", vs_rr("ttft_p50"), "<= 0.7x"),
            row("loaded TTFT p99 vs round-robin", vs_rr("ttft_p99"), "<= 0.5x"),
            row("loaded TPOT p50 vs round-robin", vs_rr("tpot_p50"), "within 5%"),
            row("busiest worker's share of requests (loaded)",
                lambda m: _pc(loaded.get(m, {}).get("busiest_worker_share")), "<= 16%")]
    return "\n".join(rows)


def plot(all_results: dict[str, dict[str, list]], speedups: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(all_results)
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=True):
        for mode, results in all_results[phase].items():
            ttft = sorted(r.ttft * 1000 for r in results if r.error is None and r.ttft is not None)
            if not ttft:
                continue
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.step(ttft, ys, where="post", label=f"{mode} (p50 {pct(ttft, 0.5):,.0f} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{phase}: mock speedup {speedups[phase]:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Mooncake trace (20x compressed), 8 mock decode workers: TTFT CDF per mode")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
