"""KV offload benchmark: multi-turn chat on a device pool that holds ~25% of the working set,
with a host tier (offload, onboard on a prefix hit) vs without (evicted history is recomputed).

    python -m bench offload                 # CPU, the ``small`` model (~52M params, fp32), ~6 min on 2 cores
    python -m bench offload --quick         # a short smoke run (~2 min)
    python -m bench offload --json out.json

Workload: ``--convs`` conversations x ``--turns`` turns. Each turn re-sends the whole history:
the first prompt (``--first`` tokens), then per turn the model's answer (``--answer`` tokens,
greedy, EOS ignored) and a new user message (``--user`` tokens); with the defaults the last
prompts are ~1k tokens. Token ids are random, so nothing is shared between conversations:
every prefix hit is a conversation's own history.

Arrival: turns in round-robin order (turn 1 of every conversation, then turn 2 of every one,
...), ``--concurrency`` requests in flight: when one finishes the next in order is added. So
between two turns of a conversation the other conversations' turns pass through the pool,
which is what evicts a history from a small device pool.

Engine: in-process (``Engine``, driven step by step in this thread), the same object a worker
runs. TTFT = wall time from ``add()`` to the end of the step that produced the request's first
token (queueing behind in-flight requests included). Percentiles over all requests, and over
turns 2+ only (first turns have no history to find: they cost the same in both runs). Prefix
hit rate = cached prompt tokens / prompt tokens (the usage ``cached_tokens``).

Device pool: ``--device-share`` of the working set (the blocks of every conversation's last
history); host tier: the whole working set plus headroom. Both runs use the same device pool;
a third, unlimited run (``--unlimited``) shows the bound.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import model_dir as resolve_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

BENCHMARK = Benchmark(
    name="offload",
    measures="TTFT of multi-turn chat on a device pool a quarter of the working set, with a host tier "
             "(offload, onboard on a prefix hit) against without (recompute), in-process (CPU, `small`)",
    target="TTFT p50 with offload <= 0.5x recompute",
    minutes=3,
    smoke=("--model", "tiny", "--convs", "2", "--turns", "2", "--first", "64", "--user", "16", "--answer", "4",
           "--concurrency", "2", "--threads", "1"),
)

BLOCK_SIZE = 16
TARGET = 0.5  # TTFT p50 with offload <= 0.5x without
BUSY_SHARE = 0.85  # below this share of the cores, a run's times are flagged as noisy


@dataclass
class Workload:
    convs: int
    turns: int
    first: int
    user: int
    answer: int
    concurrency: int
    seed: int = 0

    def messages(self) -> tuple[list[list[int]], list[list[list[int]]]]:
        rng = random.Random(self.seed)
        firsts = [[rng.randrange(8, 4096) for _ in range(self.first)] for _ in range(self.convs)]
        users = [[[rng.randrange(8, 4096) for _ in range(self.user)] for _ in range(self.convs)]
                 for _ in range(self.turns)]
        return firsts, users

    @property
    def last_prompt_tokens(self) -> int:
        return self.first + (self.turns - 1) * (self.answer + self.user)

    @property
    def working_set_blocks(self) -> int:
        return self.convs * -(-(self.last_prompt_tokens + self.answer) // BLOCK_SIZE)


@dataclass
class Result:
    label: str
    device_blocks: int
    host_blocks: int
    requests: int
    seconds: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    later_ttft_p50_ms: float  # turns 2+: the requests a history can help
    later_ttft_p99_ms: float
    hit_rate: float
    cpu_share: float  # CPU time of this process / (wall x threads): below ~0.85 others shared the cores
    prompt_tokens: int
    cached_tokens: int
    computed_prompt_tokens: int
    counters: dict
    outputs: list

    def row(self) -> str:
        return (f"{self.label:<22} {self.device_blocks:>6} {self.host_blocks:>6} {self.ttft_p50_ms:>9.0f} "
                f"{self.ttft_p90_ms:>9.0f} {self.ttft_p99_ms:>9.0f} {self.later_ttft_p50_ms:>9.0f} "
                f"{self.later_ttft_p99_ms:>9.0f} {self.hit_rate:>7.1%} {self.computed_prompt_tokens:>9} "
                f"{self.seconds:>7.1f} {self.cpu_share:>5.0%}")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run(label: str, model: Path, w: Workload, device_blocks: int, host_blocks: int) -> Result:
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                 num_kv_blocks=device_blocks, host_kv_blocks=host_blocks or None,
                                 max_num_seqs=w.concurrency, max_num_batched_tokens=2048))
    # warm-up on ids no conversation uses, then forget it
    engine.generate([[3, 4, 5, 6] * 8], SamplingParams(max_tokens=2, ignore_eos=True))
    firsts, users = w.messages()
    histories = [list(f) for f in firsts]
    order = [(t, c) for t in range(w.turns) for c in range(w.convs)]
    done_turns = [0] * w.convs  # turns finished per conversation
    params = SamplingParams(max_tokens=w.answer, temperature=0.0, ignore_eos=True)
    in_flight: dict[str, tuple[int, int, float, object]] = {}
    ttft: list[float] = []
    later: list[float] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = cached_tokens = 0
    nxt = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    while nxt < len(order) or in_flight:
        while nxt < len(order) and len(in_flight) < w.concurrency:
            t, c = order[nxt]
            if done_turns[c] < t:  # its previous turn is still running: keep the order, wait
                break
            seq = engine.new_sequence(histories[c], params)
            in_flight[seq.request_id] = (t, c, time.perf_counter(), seq)
            engine.add(seq)
            nxt += 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            t, c, added, seq = in_flight[out.request_id]
            if out.num_output_tokens == 1:
                ttft.append(now - added)
                if t > 0:
                    later.append((now - added) * 1000)
                prompt_tokens += out.num_prompt_tokens
                cached_tokens += out.num_cached_tokens
            if out.finish_reason is not None:
                del in_flight[out.request_id]
                outputs[(t, c)] = list(seq.output_token_ids)
                histories[c] = [*histories[c], *seq.output_token_ids, *users[t][c]] if t + 1 < w.turns else histories[c]
                done_turns[c] = t + 1
    seconds = time.perf_counter() - t0
    cpu_share = (time.process_time() - cpu0) / (seconds * torch.get_num_threads())
    counters = engine.kv_counters()
    counters["preemptions"] = engine.scheduler.num_preemptions
    ms = [x * 1000 for x in ttft]
    return Result(
        label=label, device_blocks=device_blocks, host_blocks=host_blocks, requests=len(ttft), seconds=seconds,
        ttft_p50_ms=percentile(ms, 0.5), ttft_p90_ms=percentile(ms, 0.9), ttft_p99_ms=percentile(ms, 0.99),
        ttft_mean_ms=statistics.fmean(ms), later_ttft_p50_ms=percentile(later, 0.5),
        later_ttft_p99_ms=percentile(later, 0.99), cpu_share=cpu_share, hit_rate=cached_tokens / prompt_tokens, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, computed_prompt_tokens=prompt_tokens - cached_tokens, counters=counters,
        outputs=[outputs[k] for k in sorted(outputs)],
    )


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", default=None, help="model directory, or a generated size (default: small)")
    p.add_argument("--convs", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first", type=int, default=400, help="tokens of a conversation's first prompt")
    p.add_argument("--user", type=int, default=100, help="tokens of each later user message")
    p.add_argument("--answer", type=int, default=24, help="tokens of each answer")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--device-share", type=float, default=0.25, help="device pool / working set")
    p.add_argument("--unlimited", action="store_true", help="also run with a device pool for the whole working set")
    p.add_argument("--quick", action="store_true", help="8 conversations x 4 turns")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parse(BENCHMARK, p, argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.convs, args.turns = min(args.convs, 8), min(args.turns, 4)
    w = Workload(args.convs, args.turns, args.first, args.user, args.answer, args.concurrency)
    model = resolve_model(args.model, "small")
    ws = w.working_set_blocks
    device = max(int(ws * args.device_share), -(-(w.last_prompt_tokens + w.answer) // BLOCK_SIZE) * w.concurrency)
    host = ws + ws // 4
    probe = Engine(EngineConfig(model, device="cpu", num_kv_blocks=16))
    block_mib = probe.kv_spec.block_bytes / (1 << 20)
    del probe
    print(f"model {model}, {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"workload: {w.convs} conversations x {w.turns} turns, first prompt {w.first}, +{w.answer} answer "
          f"+{w.user} user per turn (last prompt {w.last_prompt_tokens} tokens), concurrency {w.concurrency}, "
          f"round-robin arrival")
    print(f"working set {ws} blocks ({ws * block_mib:.0f} MiB); device pool {device} blocks "
          f"({device / ws:.0%}); host tier {host} blocks ({host * block_mib:.0f} MiB)")
    results = [
        run("recompute (no tiers)", model, w, device, 0),
        run("host offload", model, w, device, host),
    ]
    if args.unlimited:
        results.append(run("device unlimited", model, w, ws + 64, 0))
    print()
    print(f"{'':<22} {'device':>6} {'host':>6} {'TTFT, all turns (ms)':^29} {'turns 2+ (ms)':^19} "
          f"{'hit':>7} {'computed':>9} {'wall':>7} {'cpu':>5}")
    print(f"{'run':<22} {'blocks':>6} {'blocks':>6} {'p50':>9} {'p90':>9} {'p99':>9} {'p50':>9} {'p99':>9} "
          f"{'rate':>7} {'prompt':>9} {'s':>7} {'share':>5}")
    for r in results:
        print(r.row())
    base, off = results[0], results[1]
    ratio50 = off.ttft_p50_ms / base.ttft_p50_ms
    ratio99 = off.ttft_p99_ms / base.ttft_p99_ms
    same = sum(a == b for a, b in zip(base.outputs, off.outputs, strict=True))
    c = off.counters
    print()
    print(f"TTFT p50 offload/recompute = {ratio50:.2f}x (target <= {TARGET}x: {'met' if ratio50 <= TARGET else 'NOT met'}); "
          f"p99 {ratio99:.2f}x; turns 2+: p50 {off.later_ttft_p50_ms / base.later_ttft_p50_ms:.2f}x, "
          f"p99 {off.later_ttft_p99_ms / base.later_ttft_p99_ms:.2f}x")
    print(f"offload run: hit blocks device {c['hit_blocks_device']}, host {c['hit_blocks_host']}; "
          f"host stored {c['host_stored_blocks']}, evicted {c['host_evicted_blocks']}; "
          f"preemptions {c['preemptions']}")
    print(f"greedy outputs identical between the two runs: {same}/{len(base.outputs)} requests")
    if min(r.cpu_share for r in results) < BUSY_SHARE:
        print(f"note: a run had under {BUSY_SHARE:.0%} of {args.threads} cores (load average now "
              f"{os.getloadavg()[0]:.1f}): other processes shared the machine, its times are inflated")
    return emit(BENCHMARK, {"workload": asdict(w), "ttft_p50_ratio": ratio50, "ttft_p99_ratio": ratio99,
                            "identical_outputs": same, "requests": len(base.outputs), "results": [
                                {k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]}, args)
