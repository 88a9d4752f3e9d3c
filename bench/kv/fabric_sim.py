"""Issue 20's trace replay in simulated time: no processes, no bus, no wall clock.

    python -m bench fabric-sim      # --trace: default ../shared/data/traces/mooncake_synthetic_trace.jsonl

The same requests as ``python -m bench trace-replay`` (its token mapping and 20x compression) through
8 ``MockEngine``s (the real scheduler, block pools, host tiers, pins and peer stage, the mocker's
timing model) and the real router (``KvIndex`` fed by the engines' KV events, ``pick_worker``,
the router's load view from once-a-second load reports plus its own in-flight decisions), on a
discrete-event clock. Times are in the mesh's seconds at the given mocker ``--speedup`` (a step
of the timing model's ``ms`` takes ``ms / speedup`` ms), so TTFT and TPOT compare with a replay
through the mesh, less its host overheads (gateway, bus, Python): what the policy itself does,
on any machine, however busy, in a minute.

Peer fetch as ``mocker.worker`` does it: the holder pins at its next step boundary, sends
for ``TimingModel.fetch_ms`` (one fetch at a time per NIC), unpins; the requester stages the
blocks and admits the request. Not modelled: the gateway and bus latency (~ms), the decision's
broadcast, events arriving a little after the step that made them.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Benchmark, emit, parse, parser
from bench.mesh import trace_replay as tr
from bench.mesh.replay_report import (
    attribution,
    balance,
    issue_table,
    reuse_table,
    summarize,
    table,
)
from engine.sampling import SamplingParams
from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.kvevents import to_wire
from mesh.protocol import KvEventBatch
from mesh.router.index import KvIndex
from mesh.router.policy import RouterConfig, RouteRequest, WorkerLoad, pick_worker
from mocker.engine import MockConfig, MockEngine

BENCHMARK = Benchmark(
    name="fabric-sim",
    measures="the trace replay's KV fabric (tiers, peer fetch) in simulated time, against trace-replay's targets: "
             "the real router, block pools and mocker engines on a discrete-event clock, no processes",
    minutes=45,
    smoke=("--limit", "30", "--modes", "kv", "--phases", "free"),
)
REPORT_S = 1.0  # load reports, as workers send them
REPORT_MARGIN = 0.25  # mesh/router/router.py: a report this much newer than a decision shows it
FETCH_LEASE_S = 5.0


@dataclass
class Worker:
    wid: str
    engine: MockEngine
    stepping: bool = False
    batch: int = 0  # KV event batches published
    commands: list = field(default_factory=list)  # run between steps (pins, releases)
    report: tuple[int, int] = (0, 0)  # (pending prefill tokens, KV blocks used) of the last load report
    report_at: float = -1.0
    inflight: dict[str, list] = field(default_factory=dict)  # request -> [decided at, prompt blocks, new blocks]
    nic_free: float = 0.0


class Sim:
    def __init__(self, requests, oracle, mode: str, speedup: float, workers: int, kv_blocks: int, host_blocks: int,
                 seed: int = 0):
        router_mode, extra = tr.VARIANTS[mode]
        host = host_blocks if tr.HOST in extra else 0
        self.peer = "--peer-fetch" in extra
        self.speedup = speedup
        self.config = RouterConfig(mode=router_mode, peer_fetch=self.peer)
        cfg = MockConfig(block_size=tr.BLOCK_SIZE, num_blocks=kv_blocks, speedup=1e12, host_kv_blocks=host,
                         peer_fetch=self.peer)
        self.workers = {f"w{i}": Worker(f"w{i}", MockEngine(cfg)) for i in range(workers)}
        self.index = KvIndex()
        for w in self.workers:
            self.index.load_snapshot(w, 0, {})
        self.rng = random.Random(seed)
        self.requests, self.oracle = requests, oracle
        self.results = [tr.Result(r.index, r.at, oracle_cached=o) for r, o in zip(requests, oracle, strict=True)]
        self.seqs: dict[str, tuple] = {}  # request id -> (result, worker, sequence)
        self.now = 0.0
        self._heap: list = []
        self._n = itertools.count()
        self.rr = 0
        self.hseed = hash_seed(DEFAULT_HASH_KEY, tr.MODEL)
        self.fetches = {"peer_fetch_requests": 0, "peer_fetch_ok": 0, "peer_fetch_blocks": 0}

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._n), fn, args))

    def run(self) -> list:
        for r in self.requests:
            self.at(r.at, self.arrive, r)
        self.at(0.0, self.reports)
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
            if fn == self.reports and len(self.seqs) == 0 and all(x.e2e is not None for x in self.results):
                break
        return self.results

    # -- the router ------------------------------------------------------------------------------
    def arrive(self, r) -> None:
        rid = f"r{r.index}"
        res = self.results[r.index]
        hashes = block_hashes(r.prompt, tr.BLOCK_SIZE, self.hseed)
        self.index.expire(now=self.now)
        matches = self.index.match(hashes) if self.config.mode == "kv" else {}
        loads = [self.load_of(w) for w in self.workers.values()]
        d = pick_worker(RouteRequest(len(r.prompt), tr.BLOCK_SIZE, tuple(hashes)), loads, matches, self.config,
                        self.rng, self.rr)
        self.rr += 1
        w = self.workers[d.worker_id]
        w.inflight[rid] = [self.now, -(-len(r.prompt) // tr.BLOCK_SIZE), d.new_blocks]
        if hashes and self.config.mode == "kv":
            self.index.predict(d.worker_id, hashes, self.config.pending_ttl, now=self.now)
        res.worker, res.overlap_blocks, res.hit_blocks, res.fetch_blocks = (d.worker_id, d.overlap_blocks,
                                                                            d.hit_blocks, d.fetch_blocks)
        seq = w.engine.new_sequence(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                             ignore_eos=True), request_id=rid)
        self.seqs[rid] = (res, w, seq, self.now)
        res.prompt_tokens = len(r.prompt)
        if d.fetch_source:
            self.fetches["peer_fetch_requests"] += 1
            want = hashes[d.hit_blocks:d.hit_blocks + d.fetch_blocks]
            self.command(self.workers[d.fetch_source], self.pin, rid, want)
        else:
            self.admit(rid)

    def load_of(self, w: Worker) -> WorkerLoad:
        pending, used = w.report
        fresh = list(w.inflight.values())
        return WorkerLoad(w.wid, active_blocks=used,
                          pending_prefill_blocks=-(-pending // tr.BLOCK_SIZE) + sum(x[2] for x in fresh),
                          inflight_blocks=sum(x[1] for x in fresh), total_blocks=w.engine.pool.num_blocks,
                          costs=w.engine.kv_costs)

    def reports(self) -> None:
        for w in self.workers.values():
            s = w.engine.scheduler
            pending = sum(q.num_uncomputed_tokens for q in s.waiting) + sum(
                q.num_uncomputed_tokens for q in s.running if q.is_prefilling)
            w.report = (pending, w.engine.pool.num_used)
            for rid in [k for k, v in w.inflight.items() if v[0] < self.now - REPORT_MARGIN]:
                del w.inflight[rid]
        if any(x.e2e is None for x in self.results):
            self.at(self.now + REPORT_S, self.reports)

    # -- peer fetch ------------------------------------------------------------------------------
    def pin(self, holder: Worker, rid: str, want: list[int]) -> None:
        run = holder.engine.pins.pin(rid, want, FETCH_LEASE_S)
        ms = holder.engine.config.timing.fetch_ms(run.tier_counts, tr.BLOCK_SIZE) if len(run) else 0.0
        start = max(self.now, holder.nic_free)
        holder.nic_free = start + ms / 1000 / self.speedup
        self.at(holder.nic_free, self.fetched, holder, rid, list(run.hashes))

    def fetched(self, holder: Worker, rid: str, hashes: list[int]) -> None:
        self.command(holder, lambda h, r: h.engine.pins.release(r), rid)
        _, w, _, _ = self.seqs[rid]
        if hashes:
            w.engine.stage_peer_blocks(hashes)
            self.fetches["peer_fetch_ok"] += 1
            self.fetches["peer_fetch_blocks"] += len(hashes)
        self.admit(rid)

    # -- the engines -----------------------------------------------------------------------------
    def admit(self, rid: str) -> None:
        _, w, seq, _ = self.seqs[rid]
        w.engine.add(seq)
        self.kick(w)

    def command(self, w: Worker, fn, *args) -> None:
        """Run ``fn(w, *args)`` between ``w``'s steps (at once if it is idle), as ``EngineLoop.call``."""
        if w.stepping:
            w.commands.append((fn, args))
        else:
            fn(w, *args)
            self.kick(w)

    def kick(self, w: Worker) -> None:
        if w.stepping or not w.engine.has_work:
            return
        ms0 = w.engine.simulated_ms
        outs = w.engine.step()
        w.stepping = True
        self.at(self.now + (w.engine.simulated_ms - ms0) / 1000 / self.speedup, self.step_done, w, outs)

    def step_done(self, w: Worker, outs) -> None:
        w.stepping = False
        for out in outs:
            res, _, _, arrived = self.seqs[out.request_id]
            if res.ttft is None:
                res.ttft = self.now - arrived
                res.cached_tokens = out.num_cached_tokens
                if rec := w.inflight.get(out.request_id):
                    rec[2] = 0
            if out.finish_reason is not None:
                res.e2e = self.now - arrived
                res.completion_tokens = out.num_output_tokens
                w.inflight.pop(out.request_id, None)
                del self.seqs[out.request_id]
        events = w.engine.pool.events.drain()
        if events:
            w.batch += 1
            self.index.apply(KvEventBatch(w.wid, tr.MODEL, w.batch, to_wire(events)))
        commands, w.commands = w.commands, []
        for fn, args in commands:
            fn(w, *args)
        self.kick(w)


def simulate(requests, oracle, mode: str, speedup: float, args) -> dict:
    sim = Sim(requests, oracle, mode, speedup, args.decode, args.kv_blocks, args.host_blocks, args.seed)
    results = sim.run()
    wall = max((r.at for r in requests), default=0.0)
    run = {"wall_s": max(wall, 1e-9), "client_cpu_cores": 0.0, "other_cpu_cores": 0.0}
    counters = {w.wid: {**w.engine.kv_counters(), "preemptions": w.engine.scheduler.num_preemptions}
                for w in sim.workers.values()}
    counters["fetches"] = sim.fetches
    run.update(balance(results, []))
    run.update(attribution(results, counters))
    return summarize(results, run)


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--trace", type=Path, default=tr.TRACE, help="Mooncake trace JSONL (default: the shared one)")
    p.add_argument("--speedup-trace", type=float, default=20.0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--modes", default=",".join(tr.DEFAULT_MODES))
    p.add_argument("--phases", default="free,loaded")
    p.add_argument("--free-speedup", type=float, default=10.0)
    p.add_argument("--loaded-speedup", type=float, default=3.0)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--host-blocks", type=int, default=None, help="default: 4x --kv-blocks")
    p.add_argument("--seed", type=int, default=0)
    args = parse(BENCHMARK, p, argv)
    args.host_blocks = args.host_blocks or 4 * args.kv_blocks
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}")
    requests = tr.load_trace(args.trace, args.speedup_trace, args.limit, None)
    oracle = tr.oracle_hits(requests)
    modes = args.modes.split(",")
    phases: dict[str, dict[str, dict]] = {}
    for phase in args.phases.split(","):
        speedup = args.free_speedup if phase == "free" else args.loaded_speedup
        phases[phase] = {}
        for mode in modes:
            s = phases[phase][mode] = simulate(requests, oracle, mode, speedup, args)
            print(f"  {phase} {mode}: reuse {s['hit_rate']:.1%}, TTFT p50 {s['ttft_p50'] * 1e3:,.0f} ms "
                  f"p99 {s['ttft_p99'] * 1e3:,.0f} ms, TPOT p50 {(s['tpot_p50'] or 0) * 1e3:.1f} ms", flush=True)
        print()
        print(table(phase, speedup, phases[phase]))
        print()
        print(reuse_table(phase, phases[phase]))
        print()
    print(issue_table(phases))
    speedups = {ph: args.free_speedup if ph == "free" else args.loaded_speedup for ph in phases}
    return emit(BENCHMARK, {"requests": len(requests), "oracle_hit_rate": sum(oracle) / sum(len(r.prompt) for r in requests),
                            "phases": {ph: {"mock_speedup": speedups[ph], "modes": m} for ph, m in phases.items()}}, args)
