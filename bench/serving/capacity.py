"""Capacity at real pace: how many concurrent token-by-token streams an OpenAI endpoint holds.

    python -m bench capacity URL [--model tiny] [--pgids 123,456]      # any endpoint (Dynamo's too)
    python -m bench capacity --start-mesh 8 --tokenizer DIR            # starts pdmesh: nats, gateway, 8 mocks

A step-up load: at each level C (``--levels``), C clients each stream chat completions back to
back (``--tokens`` each, ``ignore_eos``) for ``--seconds``; a level is *held* when no request failed,
every request got its tokens, and the p99 of the gaps between a stream's SSE events is at most
``--gap-factor`` (3) x ``--step-ms`` (the simulated decode step, 8 ms: pdmesh's mock default).
The run stops at the first level not held and prints the largest one held, with its tokens/s,
TTFT p99 and the host CPU per generated token of the server's processes (``--pgids``: process
groups, read from /proc as ``shared/peers/side_by_side.sh`` does; ``dynamo_up.sh`` prints them).

Against Dynamo: ``bash ../shared/peers/dynamo_up.sh PORT 8`` (8 mocker workers at real pace), then
``python -m bench capacity http://127.0.0.1:PORT --pgids G1,G2``. The load generator is a raw
asyncio HTTP/1.1 client (``bench/common/sse_client.py``): httpx would spend more CPU per event than the
servers do. On a shared machine every figure moves with the other processes' load: compare two
servers in one sitting, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.sse_client import Connection

BENCHMARK = Benchmark(
    name="capacity",
    measures="how many concurrent token-by-token streams an OpenAI endpoint holds at real pace (a step-up load; "
             "held: no error and chunk-gap p99 <= 3 simulated steps), with host CPU per token; pdmesh or any URL",
    minutes=3,
    smoke=("--start-mesh", "8", "--dry-run"),
)

WORDS = ["hello", "world", "how", "are", "you", "the", "a", "is", "of", "and", "to", "in"]


@dataclass
class Level:
    streams: int
    requests: int = 0
    errors: int = 0
    short: int = 0  # requests that got fewer tokens than asked
    tok_s: float = 0.0
    ttft_p99_ms: float = 0.0
    gap_p50_ms: float = 0.0
    gap_p99_ms: float = 0.0
    cpu_us_per_token: float | None = None
    held: bool = False
    first_error: str = ""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else 0.0


def group_cpu(pgids: set[str]) -> float:
    """CPU seconds (user + system) of every process in these process groups."""
    total = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f[2] in pgids:
                total += int(f[11]) + int(f[12])
    return total / os.sysconf("SC_CLK_TCK")


async def one_request(conn: Connection, model: str, tokens: int, out: dict) -> None:
    prompt = " ".join(random.choice(WORDS) for _ in range(100))
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                       "min_tokens": tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    t0 = time.monotonic()
    last, got, gaps = None, 0, []
    async for now, data in conn.post_sse("/v1/chat/completions", body):
        if data == b"[DONE]":
            continue  # read on to the end of the chunked body: the connection is kept alive
        if last is None:
            out["ttft"].append(now - t0)
        else:
            gaps.append(now - last)
        last = now
        if b'"usage":{' in data:
            got = json.loads(data)["usage"]["completion_tokens"]
    out["gaps"] += gaps
    out["tokens"] += got
    out["requests"] += 1
    out["short"] += got < tokens


async def run_level(host: str, port: int, model: str, streams: int, tokens: int, seconds: float,
                    pgids: set[str]) -> Level:
    out = {"ttft": [], "gaps": [], "tokens": 0, "requests": 0, "short": 0, "errors": 0}
    deadline = time.monotonic() + seconds

    async def client() -> None:
        conn = Connection(host, port)
        try:
            while time.monotonic() < deadline:
                try:
                    await one_request(conn, model, tokens, out)
                except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as e:
                    out["errors"] += 1
                    out.setdefault("first_error", repr(e)[:200])
                    await conn.close()
                    conn = Connection(host, port)
        finally:
            await conn.close()

    cpu0, t0 = group_cpu(pgids) if pgids else 0.0, time.monotonic()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall = time.monotonic() - t0
    lv = Level(streams, out["requests"], out["errors"], out["short"], round(out["tokens"] / wall, 1),
               round(1000 * pct(out["ttft"], 0.99), 1), round(1000 * pct(out["gaps"], 0.5), 2),
               round(1000 * pct(out["gaps"], 0.99), 1))
    lv.first_error = out.get("first_error", "")
    if pgids and out["tokens"]:
        lv.cpu_us_per_token = round((group_cpu(pgids) - cpu0) / out["tokens"] * 1e6, 1)
    return lv


class LocalMesh:
    """nats-server, ``mesh gateway`` and N ``mesh worker mock`` at real pace, each its own process group."""

    @staticmethod
    def commands(workers: int, tokenizer: str, model: str, worker_flags, js_dir: str, nport: int,
                 port: int) -> list[tuple[str, list[str]]]:
        """(name, argv) of each process, in start order."""
        nats = f"nats://127.0.0.1:{nport}"
        out = [("nats", [os.path.join(os.path.dirname(sys.executable), "nats-server"), "-js", "-sd", js_dir,
                         "-a", "127.0.0.1", "-p", str(nport)]),
               ("gateway", [sys.executable, "-m", "cli", "gateway", "--nats", nats, "--model", tokenizer,
                            "--served-name", model, "--port", str(port)])]
        return out + [(f"mock{k}", [sys.executable, "-m", "cli", "worker", "mock", "--nats", nats, "--served-name",
                                    model, "--block-size", "16", "--mock-speedup", "1", *worker_flags])
                      for k in range(workers)]

    def __init__(self, workers: int, tokenizer: str, model: str, worker_flags: list[str] = ()):
        from mesh.natsserver import free_port

        self.dir = tempfile.mkdtemp(prefix="pdmesh-capacity-")
        self.port, nport = free_port(), free_port()
        self.procs = []
        for name, argv in self.commands(workers, tokenizer, model, worker_flags, self.dir + "/js", nport, self.port):
            self.procs.append(self._spawn(argv, name))
            if name == "nats":
                time.sleep(1)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(120):
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if model in r.read().decode():
                        time.sleep(3)  # the workers' cards reach the router
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise SystemExit(f"pdmesh did not come up; logs in {self.dir}")

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, name + ".log"), "w") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pgids(self) -> set[str]:
        return {str(p.pid) for p in self.procs}

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def step_up(url: str, a: argparse.Namespace, pgids: set[str]) -> list[Level]:
    u = urlsplit(url)
    limit = a.gap_factor * a.step_ms
    await run_level(u.hostname, u.port or 80, a.model, min(8, a.levels[0]), a.tokens, 3.0, set())  # warm-up
    levels = []
    for c in a.levels:
        lv = await run_level(u.hostname, u.port or 80, a.model, c, a.tokens, a.seconds, pgids)
        lv.held = lv.requests > 0 and not lv.errors and not lv.short and lv.gap_p99_ms <= limit
        levels.append(lv)
        print(json.dumps(asdict(lv)) + (f"  first error: {lv.first_error}" if lv.first_error else ""), flush=True)
        if not lv.held:
            break
    return levels


def main(argv: list[str] | None = None) -> int:
    ap = parser(BENCHMARK, __doc__)
    ap.add_argument("url", nargs="?")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=15.0, help="per level")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024])
    ap.add_argument("--step-ms", type=float, default=8.0, help="the simulated decode step")
    ap.add_argument("--gap-factor", type=float, default=3.0)
    ap.add_argument("--pgids", default="", help="comma-separated process groups whose CPU is the server's")
    ap.add_argument("--start-mesh", type=int, default=0, metavar="WORKERS", help="start pdmesh with this many mocks")
    ap.add_argument("--worker-flags", default="", help="--start-mesh: extra flags of each mock worker")
    ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/pdmesh-peers/tok32k"))
    ap.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    a = parse(BENCHMARK, ap, argv)
    if a.dry_run:
        if a.start_mesh:
            for name, cmd in LocalMesh.commands(a.start_mesh, a.tokenizer, a.model, a.worker_flags.split(), "JS_DIR",
                                                0, 0):
                print(f"DRY RUN: {name}: {' '.join(cmd)}")
        print(f"DRY RUN: levels {a.levels}, {a.seconds:g} s each, held at chunk-gap p99 <= "
              f"{a.gap_factor * a.step_ms:g} ms")
        return emit(BENCHMARK, summary(a.url or "(mesh)", a, []), a)
    mesh = LocalMesh(a.start_mesh, a.tokenizer, a.model, a.worker_flags.split()) if a.start_mesh else None
    if mesh is None and not a.url:
        ap.error("give a URL or --start-mesh N")
    try:
        url = mesh.url if mesh else a.url
        pgids = mesh.pgids if mesh else {g for g in a.pgids.split(",") if g}
        levels = asyncio.run(step_up(url, a, pgids))
    finally:
        if mesh is not None:
            mesh.stop()
    return emit(BENCHMARK, summary(url, a, levels), a)


def summary(url: str, a: argparse.Namespace, levels: list[Level]) -> dict:
    held = [lv for lv in levels if lv.held]
    best = held[-1] if held else None
    return {"url": url, "held_streams": best.streams if best else 0, "limit_gap_p99_ms": a.gap_factor * a.step_ms,
            "at_held": asdict(best) if best else None, "levels": [asdict(lv) for lv in levels]}
