"""Where a request's time to first token goes, for the slowest 1%: the pdmesh half of
``../shared/peers/side_by_side.sh`` (nats-server, ``mesh gateway`` with the KV router, 2
``mesh worker mock`` stepping at a fixed ``--step-ms`` with prefill almost free, as STEP=match
runs them) under the same closed-loop chat load (C streams, N requests, T tokens, a 100-word
prompt), with every process exporting its spans in batches from a thread of its own
(``OTEL_TRACES_EXPORTER=console`` to a file: the synchronous ``file`` exporter cost the gateway
more than its requests did). Each request's
spans share one trace (the gateway's server span, its child spans, the worker's, continued over
the bus); the client records when it sent each request and when its first token came, by wall
clock, and finds the trace by the completion's id. The parts:

    to the gateway    client send -> the gateway's handler starts (accept, read, the loop's backlog)
    parse+tokenise    handler start -> the chat template rendered and tokenized
    route             -> the router decided (and the gateway's bookkeeping before it)
    to the worker     -> the worker's request span starts (publish, NATS, the worker's loop)
    admit             -> the engine has it (the admission waits for a step boundary)
    wait for prefill  -> its first token, less one step (the scheduler's prompt budget per step)
    prefill step      one step (the mock's prefill is nearly free: the step it rides in)
    first chunk out   the worker emits it -> the client reads it (link or bus, detokenize, SSE)

Spans cost each process some CPU: read the parts, not the TTFT, from this benchmark.

    python -m bench ttft-parts [--streams 512] [--requests 3000] [--step-ms 12] [--tok DIR]

The last line is the result object.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser
from bench.common.registry import ROOT
from bench.common.sse_client import Connection
from mesh.natsserver import EmbeddedNats, free_port

BENCHMARK = Benchmark(
    name="ttft-parts",
    measures="a request's time to first token in parts (to the gateway, parse+tokenise, route, to the worker, "
             "admit, wait for prefill, prefill step, first chunk out) for the slowest 1%, in the pdmesh half of "
             "side_by_side.sh at C=512 (tracing on)",
    target="find the wait that dominates the TTFT tail at C=512 (issue 51)",
    minutes=2,
    smoke=("--dry-run",),
)

WORDS = ["hello", "world", "how", "are", "you", "the", "a", "is", "of", "and", "to", "in"]
PARTS = ("to the gateway", "parse+tokenise", "route", "to the worker", "admit", "wait for prefill",
         "prefill step", "first chunk out")


async def load(url: str, model: str, n: int, c: int, tokens: int) -> list[dict]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    jobs = list(range(n))
    out: list[dict] = []
    offset = time.time() - time.monotonic()  # monotonic -> wall clock, as the spans keep time

    async def slot() -> None:
        conn = Connection(host, int(port))
        try:
            while jobs:
                jobs.pop()
                prompt = " ".join(random.choice(WORDS) for _ in range(100))
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": tokens, "stream": True, "ignore_eos": True,
                                   "min_tokens": tokens}).encode()
                sent, first, rid = time.time(), None, None
                async for at, data in conn.post_sse("/v1/chat/completions", body):
                    if data == b"[DONE]":
                        continue
                    if first is None:
                        event = json.loads(data)
                        if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                            first, rid = at + offset, event["id"]
                if first is not None:
                    out.append({"rid": rid, "sent": sent, "first": first})
        finally:
            await conn.close()

    await asyncio.gather(*(slot() for _ in range(c)))
    return out


def spans_by_trace(paths: list[Path]) -> dict[str, dict[str, dict]]:
    traces: dict[str, dict[str, dict]] = {}
    dec = json.JSONDecoder()
    for path in paths:
        if not path.exists():
            continue
        text, pos = path.read_text(), 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos >= len(text):
                break
            s, pos = dec.raw_decode(text, pos)  # the console exporter's objects, one after another
            trace = s["context"]["trace_id"]
            name = s["name"]
            if name.startswith("POST "):
                name = "POST"
            traces.setdefault(trace, {}).setdefault(name, s)  # the first of a name (a retry's come later)
    return traces


def _t(span: dict, key: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(span[key].replace("Z", "+00:00")).timestamp()


def parts_of(req: dict, spans: dict[str, dict], step_s: float) -> dict[str, float] | None:
    need = ("POST", "template+tokenize", "route", "decode.request", "prefill.local", "decode")
    if any(k not in spans for k in need):
        return None
    post, tok, route = _t(spans["POST"], "start_time"), _t(spans["template+tokenize"], "end_time"), \
        _t(spans["route"], "end_time")
    at_worker, admitted = _t(spans["decode.request"], "start_time"), _t(spans["prefill.local"], "start_time")
    emitted = _t(spans["decode"], "start_time")
    waited = emitted - admitted
    return {"to the gateway": post - req["sent"], "parse+tokenise": tok - post, "route": route - tok,
            "to the worker": at_worker - route, "admit": admitted - at_worker,
            "wait for prefill": max(0.0, waited - step_s), "prefill step": min(waited, step_s),
            "first chunk out": req["first"] - emitted}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    p.add_argument("--streams", type=int, default=512)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=12.0, help="the mocks' decode step (side_by_side: Dynamo's ITL)")
    p.add_argument("--tok", default=str(Path.home() / ".cache/pdmesh-peers/tok32k"), help="the tokenizer directory")
    p.add_argument("--worker-flags", default="", help="more `mesh worker mock` flags")
    p.add_argument("--gateway-flags", default="", help="more `mesh gateway` flags")
    args = parse(BENCHMARK, p, argv)
    if args.dry_run:
        return emit(BENCHMARK, {"plan": {"streams": args.streams, "requests": args.requests, "tokens": args.tokens,
                                         "step_ms": args.step_ms, "tokenizer": args.tok}, "parts": list(PARTS)}, args)
    if not Path(args.tok).is_dir():
        print(f"ttft-parts: no tokenizer at {args.tok} (side_by_side.sh makes it; or --tok DIR)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pdmesh-ttft-"))
    procs = []
    nats = EmbeddedNats(store_dir=str(work / "js")).start()
    try:
        port = free_port()
        mesh = [sys.executable, "-m", "cli"]
        timing = [f"decode_base_ms={args.step_ms}", "decode_ms_per_seq=0", "decode_ms_per_kv_token=0",
                  "prefill_base_ms=0", "prefill_ms_per_token=0.001", "prefill_ms_per_token_ctx=0"]

        def spawn(argv, name):
            env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_QUEUE_SIZE": "200000",
                   "OTEL_BSP_SCHEDULE_DELAY": "500", "TOKENIZERS_PARALLELISM": "false"}
            procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(work / f"{name}.jsonl", "wb"),  # noqa: SIM115
                                          stderr=open(work / f"{name}.log", "wb"),  # noqa: SIM115
                                          start_new_session=True))

        spawn([*mesh, "gateway", "--nats", nats.url, "--model", args.tok, "--served-name", "tiny", "--host",
               "127.0.0.1", "--port", str(port), *args.gateway_flags.split()], "gateway")
        for k in (1, 2):
            spawn([*mesh, "worker", "mock", "--nats", nats.url, "--served-name", "tiny", "--block-size", "16",
                   *[a for t in timing for a in ("--mock-timing", t)], *args.worker_flags.split()], f"mock{k}")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                import urllib.request

                if b"tiny" in urllib.request.urlopen(url + "/v1/models", timeout=2).read():
                    break
            except OSError:
                pass
            time.sleep(1)
        time.sleep(3)
        asyncio.run(load(url, "tiny", min(args.streams, 20), min(args.streams, 20), args.tokens))  # warm-up
        reqs = asyncio.run(load(url, "tiny", args.requests, args.streams, args.tokens))
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
        nats.stop()
    traces = spans_by_trace([work / f"{n}.jsonl" for n in ("gateway", "mock1", "mock2")])
    by_rid = {}
    for spans in traces.values():
        post = spans.get("POST")
        if post is not None and post["attributes"].get("pdmesh.request_id"):
            by_rid[post["attributes"]["pdmesh.request_id"]] = spans
    rows = []
    for r in reqs:
        spans = by_rid.get(r["rid"])
        parts = parts_of(r, spans, args.step_ms / 1000) if spans else None
        if parts is not None:
            rows.append((r["first"] - r["sent"], parts))
    rows.sort(key=lambda x: x[0])
    tail = rows[-max(1, len(rows) // 100):]

    def mean_ms(items, part):
        return round(sum(x[1][part] for x in items) / len(items) * 1000, 1) if items else None

    out = {"streams": args.streams, "requests": len(reqs), "joined": len(rows),
           "step_ms": args.step_ms, "load_avg": os.getloadavg()[0],
           "ttft_p50_ms": round(rows[len(rows) // 2][0] * 1000, 1) if rows else None,
           "ttft_p99_ms": round(rows[int(len(rows) * 0.99)][0] * 1000, 1) if rows else None,
           "slowest_1pct_ms": {part: mean_ms(tail, part) for part in PARTS},
           "median_request_ms": {part: mean_ms(rows[len(rows) // 2 - 5: len(rows) // 2 + 5], part) for part in PARTS}}
    return emit(BENCHMARK, out, args)


if __name__ == "__main__":
    sys.exit(main())
