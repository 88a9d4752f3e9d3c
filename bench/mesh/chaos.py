"""Chaos: steady load while workers are killed and restarted at random and NATS restarts once.

A gateway, mocker decode and prefill workers and a nats-server run as real
processes. Clients stream completions with token ids; the mocker's tokens are
a fixed function of the sequence, so every completed stream is checked token
for token, whichever workers it went through. At the end every request is
either correct, or ended with a clear error (an HTTP error or an SSE error
event), or hung (no answer within the client timeout): the last two are
counted, hung and incorrect must be zero. It prints those counts, how many
streams the gateway migrated to another worker mid-request (and how many
requests it re-sent before their first token), and the latency of
completed requests that had a fault (a kill or the NATS restart) in flight next
to those that had none.

    python -m bench chaos [--seconds 300] [--clients 8] [--kill-every 6]
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from mesh.natsserver import EmbeddedNats, free_port
from mesh.procutil import die_with_parent
from mocker.engine import MockConfig

BENCHMARK = Benchmark(
    name="chaos",
    measures="every streamed request's tokens checked while mocker workers are killed -9 and restarted at random "
             "and NATS restarts once: correct, clear errors, hung, migrations",
    target="every request correct or a clear error; none hung",
    minutes=5,
    smoke=("--dry-run",),
)
VOCAB = MockConfig().vocab_size


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What the mocker generates for ``prompt`` (``MockEngine.token_for``), wherever it runs."""
    last, length, out = prompt[-1], len(prompt), []
    for _ in range(n):
        tok = (last * 31 + length * 17 + 7) % VOCAB
        out.append(tok)
        last, length = tok, length + 1
    return out


@dataclass
class Outcome:
    correct: int = 0
    incorrect: int = 0
    errors: int = 0
    hung: int = 0
    latencies: list[float] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each completed request
    faults: list[float] = field(default_factory=list)  # when a worker was killed or NATS went down
    migrations: int | None = None  # streams the gateway resumed on another worker mid-stream (its /metrics)
    reroutes: int | None = None  # requests it re-sent elsewhere before their first token
    error_kinds: dict[str, int] = field(default_factory=dict)
    incorrect_samples: list[str] = field(default_factory=list)
    kills: int = 0
    restarts: int = 0

    @property
    def total(self) -> int:
        return self.correct + self.incorrect + self.errors + self.hung

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


@dataclass
class Proc:
    role: str
    argv: list[str]
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, preexec_fn=die_with_parent, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


async def checked_request(client: httpx.AsyncClient, url: str, body: dict, expected: list[int], out: Outcome,
                          timeout: float) -> None:
    """One completion ``body`` streamed with its token ids, counted in ``out``: correct (the
    ``expected`` ids), incorrect, a clear error (an HTTP status or an SSE error event: its kind),
    or hung (no end within ``timeout``)."""
    body = {**body, "stream": True, "return_token_ids": True}
    t0, got = time.monotonic(), []
    try:
        async with asyncio.timeout(timeout), client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out.error(f"http {r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error(f"stream {event['error'].get('type')}")
                    return
                got += event["choices"][0].get("token_ids") or []
    except TimeoutError:
        out.hung += 1
        return
    except httpx.HTTPError as e:
        out.error(type(e).__name__)
        return
    t1 = time.monotonic()
    out.latencies.append(t1 - t0)
    out.spans.append((t0, t1))
    if got == expected:
        out.correct += 1
    else:
        out.incorrect += 1
        if len(out.incorrect_samples) < 3:
            out.incorrect_samples.append(f"{len(body['prompt'])}-token prompt, {body['max_tokens']} asked, "
                                         f"got {len(got)}")


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, out: Outcome,
                      timeout: float) -> None:
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.choice([24, 48, 700]))]  # some go to prefill
    n = rng.randrange(8, 64)
    body = {"model": "mock", "prompt": prompt, "max_tokens": n}
    await checked_request(client, url, body, expected_tokens(prompt, n), out, timeout)


def processes(nats_url: str, gw_port: int, decode: int, prefill: int) -> tuple[list[Proc], Proc]:
    """The workers (mocker decode and prefill) and the gateway, not started."""
    py = [sys.executable, "-m", "cli"]
    bus = ["--nats", nats_url, "--ns", "chaos"]
    common = ["--mock-speedup", "20", "--prefill-timeout", "4"]
    workers = [Proc("decode", [*py, "worker", "mock", *bus, *common, "--worker-id", f"chaos-dec-{i}",
                               "--disagg-threshold", "512"]) for i in range(decode)]
    workers += [Proc("prefill", [*py, "worker", "prefill", "--mock", *bus, *common,
                                 "--worker-id", f"chaos-pre-{i}"]) for i in range(prefill)]
    gateway = Proc("gateway", [*py, "gateway", *bus, "--host", "127.0.0.1", "--port", str(gw_port),
                               "--first-token-timeout", "8", "--idle-timeout", "8"])
    return workers, gateway


async def run_chaos(seconds: float = 120.0, clients: int = 6, kill_every: float = 6.0, decode: int = 3,
                    prefill: int = 2, nats_restart_at: float = 0.5, request_timeout: float = 60.0,
                    seed: int = 0, log=print) -> Outcome:
    rng = random.Random(seed)
    store = tempfile.mkdtemp(prefix="pdmesh-chaos-")
    port = free_port()
    nats = EmbeddedNats(port=port, store_dir=store).start()
    gw_port = free_port()
    workers, gateway = processes(nats.url, gw_port, decode, prefill)
    url = f"http://127.0.0.1:{gw_port}"
    for p in [*workers, gateway]:
        p.start()
    out = Outcome()
    try:
        async with httpx.AsyncClient(timeout=request_timeout) as client:
            for _ in range(240):  # the gateway sees every worker
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
            end = time.monotonic() + seconds

            async def user(i: int) -> None:
                r = random.Random(seed * 1000 + i)
                while time.monotonic() < end:
                    await one_request(client, url, r, out, request_timeout)

            async def monkey() -> None:
                restarted_nats = False
                dead: list[tuple[float, Proc]] = []
                start = time.monotonic()
                while time.monotonic() < end:
                    await asyncio.sleep(kill_every * rng.uniform(0.5, 1.5))
                    now = time.monotonic()
                    for t, p in [d for d in dead if d[0] <= now]:
                        p.start()
                        out.restarts += 1
                        dead.remove((t, p))
                    if not restarted_nats and now - start >= seconds * nats_restart_at:
                        log(f"  [{now - start:5.1f}s] restarting NATS")
                        out.faults.append(time.monotonic())
                        nats.stop()
                        await asyncio.sleep(1.0)
                        nats.start()
                        restarted_nats = True
                        continue
                    alive = [p for p in workers if p.proc.poll() is None]
                    live_decode = [p for p in alive if p.role == "decode"]
                    victims = [p for p in alive if p.role == "prefill" or len(live_decode) > 1]
                    if victims:
                        victim = rng.choice(victims)
                        log(f"  [{now - start:5.1f}s] kill -9 {victim.argv[victim.argv.index('--worker-id') + 1]}")
                        out.faults.append(time.monotonic())
                        victim.kill()
                        out.kills += 1
                        dead.append((now + rng.uniform(2.0, 6.0), victim))
                for _, p in dead:
                    p.start()
                    out.restarts += 1

            await asyncio.gather(monkey(), *(user(i) for i in range(clients)))
            out.migrations, out.reroutes = await scrape_counters(client, url)
    finally:
        gateway.stop()
        for p in workers:
            p.stop()
        nats.stop()
    return out


async def scrape_counters(client: httpx.AsyncClient, url: str) -> tuple[int | None, int | None]:
    """The gateway's (migrations, reroutes) counters from its /metrics."""
    try:
        text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return None, None
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("pdmesh_gateway_migrations_total", "pdmesh_gateway_reroutes_total"):
            found[name] = int(float(value))
    return found.get("pdmesh_gateway_migrations_total"), found.get("pdmesh_gateway_reroutes_total")


def _or_unknown(n: int | None) -> str:
    return "unknown" if n is None else str(n)


def _pcts(xs: list[float]) -> str:
    xs = sorted(xs)
    if not xs:
        return "none"
    return (f"{len(xs)} requests, p50 {statistics.median(xs) * 1e3:.0f} ms, "
            f"p99 {xs[int(0.99 * (len(xs) - 1))] * 1e3:.0f} ms")


def report(out: Outcome, seconds: float) -> str:
    lat = sorted(out.latencies)
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")
    # "during a fault": a worker was killed or NATS went down while the request was in flight
    hit = [t1 - t0 for t0, t1 in out.spans if any(t0 <= f <= t1 for f in out.faults)]
    calm = [t1 - t0 for t0, t1 in out.spans if not any(t0 <= f <= t1 for f in out.faults)]
    lines = [
        f"chaos for {seconds:.0f}s: {out.kills} kills, {out.restarts} restarts, "
        f"1 NATS restart",
        f"requests {out.total}: completed correctly {out.correct}, incorrect {out.incorrect}, "
        f"clear errors {out.errors} {out.error_kinds or ''}, hung {out.hung}",
        f"latency of completed requests: p50 {statistics.median(lat) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms"
        if lat else "no request completed",
        f"  in flight during a fault (kill or NATS restart): {_pcts(hit)}",
        f"  no fault in flight: {_pcts(calm)}",
        f"gateway: migrated mid-stream {_or_unknown(out.migrations)}, re-sent before the first token "
        f"{_or_unknown(out.reroutes)}",
    ]
    if out.incorrect_samples:
        lines.append(f"incorrect: {out.incorrect_samples}")
    return "\n".join(lines)


def summary(out: Outcome, seconds: float) -> dict:
    """The figures of ``report``'s text."""
    lat = sorted(out.latencies)
    hit = sorted(t1 - t0 for t0, t1 in out.spans if any(t0 <= f <= t1 for f in out.faults))
    p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))] * 1e3 if xs else None  # noqa: E731
    return {"seconds": seconds, "requests": out.total, "correct": out.correct, "incorrect": out.incorrect,
            "clear_errors": out.errors, "error_kinds": out.error_kinds, "hung": out.hung, "kills": out.kills,
            "restarts": out.restarts, "latency_p50_ms": statistics.median(lat) * 1e3 if lat else None,
            "latency_p99_ms": p99(lat), "fault_in_flight": {"requests": len(hit), "p99_ms": p99(hit)},
            "migrated_mid_stream": out.migrations, "resent_before_first_token": out.reroutes}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=6.0)
    p.add_argument("--decode", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        workers, gateway = processes("nats://HOST:PORT", 0, args.decode, args.prefill)
        for proc in [*workers, gateway]:
            print(f"DRY RUN: {proc.role}: {' '.join(proc.argv[1:])}")
        return emit(BENCHMARK, summary(Outcome(), args.seconds), args)
    out = asyncio.run(run_chaos(args.seconds, args.clients, args.kill_every, args.decode, args.prefill,
                                seed=args.seed))
    print(report(out, args.seconds))
    emit(BENCHMARK, summary(out, args.seconds), args)
    return 1 if out.incorrect or out.hung else 0
