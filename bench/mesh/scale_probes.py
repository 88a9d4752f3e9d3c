"""The two helper processes of ``python -m bench scale``, each its own process so that its CPU is its own:

    python -m bench.mesh.scale_probes client URL MODEL --streams C ...   the closed-loop load
    python -m bench.mesh.scale_probes natscount NATS_URL OUT.json        NATS messages by subject family

``client``: C keep-alive connections, each sending its next streamed completion (a token-id prompt:
a shared system prompt and a part of its own, ``ignore_eos``, ``return_token_ids``) as soon as its
last one ends. After ``--warmup`` seconds it prints ``measure-start``, after ``--seconds`` more
``measure-end``, stops sending, lets what runs finish and prints one JSON line: TTFT and
inter-token times of the requests started in the window, errors by message, and streams whose
tokens differ from the mocker's (a fixed function of the prompt: ``mocker.spec.next_token``), which
is how a stream resumed on another worker is checked to have finished identically.

``natscount``: a subscriber to ``>`` that speaks the NATS protocol itself (nats.py would cost more
CPU per message than the components it counts), classifies each message by its subject (and, for
JetStream deliveries, its reply subject) and writes the counts to OUT.json on SIGUSR1. nats-server
delivers it a copy of every message: its out-messages include them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import orjson

from bench.common.sse_client import Connection


# -- the load ------------------------------------------------------------------------------------
def expected_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    from mocker.spec import next_token

    out, last, length = [], prompt[-1], len(prompt)
    for _ in range(n):
        last = next_token(last, length, vocab)
        out.append(last)
        length += 1
    return out


class Load:
    def __init__(self, args):
        self.args = args
        rng = random.Random(args.seed)
        self.system = [rng.randrange(10, args.vocab) for _ in range(args.system_tokens)]
        self.rng = rng
        self.window: tuple[float, float] | None = None
        self.sending = True
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.done = 0
        self.errors: dict[str, int] = {}
        self.mismatched = 0
        self.tokens = 0

    def prompt(self) -> list[int]:
        return self.system + [self.rng.randrange(10, self.args.vocab) for _ in range(self.args.own_tokens)]

    async def stream(self, host: str, port: int) -> None:
        conn = Connection(host, port)
        a = self.args
        n = self.rng.randint(1, a.tokens)  # the first of a stream: any length, so that the streams end,
        try:  # and start again, spread over a request's time from the start (no waves to wait out)
            while self.sending:
                prompt = self.prompt()
                body = orjson.dumps({"model": a.model, "prompt": prompt, "max_tokens": n, "stream": True,
                                     "ignore_eos": True, "return_token_ids": True, "temperature": 0})
                await self.one(conn, prompt, body, n)
                n = a.tokens
        finally:
            await conn.close()

    @property
    def measuring(self) -> bool:
        return self.window is not None and self.window[1] == 0.0

    async def one(self, conn: Connection, prompt: list[int], body: bytes, n: int) -> None:
        a = self.args
        began = time.monotonic()
        counted = self.measuring  # its TTFT counts if it started in the window
        got: list[int] = []
        first = last = None
        try:
            async for at, data in conn.post_sse("/v1/completions", body):  # to its end: the connection is reused
                if data == b"[DONE]":
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    msg = str(event["error"].get("message", event["error"]))[:120]
                    self.errors[msg] = self.errors.get(msg, 0) + 1
                    return
                ids = event["choices"][0].get("token_ids") or [] if event.get("choices") else []
                if not ids:
                    continue
                measuring = self.measuring
                if first is None:
                    first = at
                    if counted:
                        self.ttft.append(first - began)
                elif measuring:
                    self.gaps.extend([(at - last) / len(ids)] * len(ids))
                if measuring:
                    self.tokens += len(ids)  # as they come: a request may outlast the window
                last = at
                got += ids
        except Exception as e:  # a refused request (HTTP status) or a connection cut
            msg = f"{type(e).__name__}: {e}"[:120]
            self.errors[msg] = self.errors.get(msg, 0) + 1
            await conn.close()
            conn.writer = None  # a fresh connection for the next request
            await asyncio.sleep(0.1)
            return
        self.done += 1
        if got != expected_tokens(prompt, n, a.vocab):
            self.mismatched += 1

    async def run(self) -> dict:
        a = self.args
        host, port = a.url.split("//", 1)[1].rsplit(":", 1)
        tasks = []
        for _ in range(a.streams):
            tasks.append(asyncio.create_task(self.stream(host, int(port))))
            if len(tasks) % 64 == 0:
                await asyncio.sleep(0.01)  # connect in waves: not 4,096 SYNs at once
        await asyncio.sleep(a.warmup)
        self.ttft, self.gaps, self.tokens = [], [], 0
        self.window = (time.monotonic(), 0.0)
        done0, tokens0, cpu0 = self.done, self.tokens, time.process_time()
        print("measure-start", flush=True)
        await asyncio.sleep(a.seconds)
        self.window = (self.window[0], time.monotonic())
        done, tokens, cpu = self.done - done0, self.tokens - tokens0, time.process_time() - cpu0
        print("measure-end", flush=True)
        self.sending = False
        await asyncio.wait(tasks, timeout=a.drain)
        for t in tasks:
            t.cancel()
        seconds = self.window[1] - self.window[0]
        return {"requests": done, "req_s": round(done / seconds, 1), "tokens_s": round(tokens / seconds, 1),
                "ttft_p50_ms": pct(self.ttft, 50), "ttft_p99_ms": pct(self.ttft, 99),
                "itl_p50_ms": pct(self.gaps, 50), "itl_p99_ms": pct(self.gaps, 99),
                "completed_total": self.done, "errors": self.errors, "mismatched": self.mismatched,
                "client_cpu_s": round(cpu, 2), "unfinished": sum(not t.done() for t in tasks)}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(len(v) * p / 100))] * 1000, 2)


def client(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.mesh.scale_probes client")
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=64)
    p.add_argument("--own-tokens", type=int, default=192)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import uvloop
        result = uvloop.run(Load(args).run())
    except ImportError:
        result = asyncio.run(Load(args).run())
    print(json.dumps(result), flush=True)


# -- the NATS counter --------------------------------------------------------------------------
def family(subject: str, reply: str) -> str:
    """What kind of message a subject carries (the subject table: mesh/subjects.py)."""
    if reply.startswith("$JS.ACK.KV_"):  # a KV watch's delivery: the stored message's subject, its ack reply
        return "registry watch deliveries"
    if subject.startswith("$KV."):
        return "registry puts (a process's cards together)" if ".set." in subject else "registry puts"
    if subject.startswith("$JS.API"):
        return "jetstream api"
    if subject.startswith("$JS."):
        return "jetstream acks"
    if subject.startswith("_INBOX."):
        if reply.startswith("$JS.ACK."):
            return "jetstream deliveries"
        return "token batches (bus)" if subject.endswith(".batch") else "replies"
    parts = subject.split(".")
    if len(parts) >= 2 and parts[1] in ("router", "planner"):
        return f"{parts[1]} decisions"
    if len(parts) >= 3:
        if parts[2] == "load":
            return "load reports"
        if parts[2] == "loads":
            return "load reports (a process's together)"
        if parts[2] == "kv":
            kind = parts[3] if len(parts) > 3 else ""
            return {"events": "kv events", "batches": "kv events (a process's together)"}.get(kind, "kv snapshots")
        if parts[2] == "decode" and len(parts) >= 5:
            return parts[4]  # generate, cancel, kv_ready, kv_fetch, ...
        return parts[2]
    return "other"


def natscount(argv: list[str]) -> None:
    url, out = argv[0], Path(argv[1])
    detail = bool(os.environ.get("SCALE_COUNT_SUBJECTS"))  # debugging: count by subject, not family
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.recv(65536)  # INFO
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"name":"scale-counter","protocol":1}'
                 b"\r\nSUB > 1\r\nPING\r\n")
    sock.settimeout(0.2)
    counts: dict[str, list[int]] = {}
    snap = [False]
    signal.signal(signal.SIGUSR1, lambda *_: snap.__setitem__(0, True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    buf = b""
    closed = False

    def write() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"at": time.time(), "closed": closed, "counts": counts}))
        os.replace(tmp, out)

    while True:
        if snap[0]:
            snap[0] = False
            write()
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        if not data:
            closed = True  # dropped (a slow consumer): the counts stop here
            write()
            return
        buf += data
        pos = 0
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            line = buf[pos:end]
            if line.startswith(b"MSG ") or line.startswith(b"HMSG "):
                f = line.split(b" ")
                size = int(f[-1])
                if len(buf) < end + 2 + size + 2:
                    break  # the payload is not all here yet
                reply = f[3].decode() if len(f) == (6 if f[0] == b"HMSG" else 5) else ""
                key = family(f[1].decode(), reply)
                if detail:
                    key += f" {f[1].decode()[:40]} {reply[:16]}"
                c = counts.setdefault(key, [0, 0])
                c[0] += 1
                c[1] += size
                pos = end + 2 + size + 2
            else:
                if line == b"PING":
                    sock.sendall(b"PONG\r\n")
                pos = end + 2
        buf = buf[pos:]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        {"client": client, "natscount": natscount}[sys.argv[1]](sys.argv[2:])
