"""Microbenchmarks of two per-token costs of the gateway's streaming path (issue 33).

    python bench/stream_costs.py [--events 20000] [--repeat 5] [--tokenizer DIR]

1. The ASGI layer per SSE event: ``gateway.streaming.SSEResponse`` over a real uvicorn httptools
   ``RequestResponseCycle`` whose transport only collects the bytes (no syscall: the Python cost
   alone), through ASGI ``send`` per event (what the gateway does) and through a raw writer of
   the same HTTP/1.1 chunks straight to the transport (what bypassing uvicorn would save); checks
   both wrote the same bytes.
2. Incremental detokenization per token: ``gateway.detok.IncrementalDetokenizer`` (a
   ``DecodeStream`` step per token since 2026-12-03; before, two decodes of a short window per
   push) against a bare ``tokenizers.decoders.DecodeStream``,
   on random 64-token streams of the side-by-side tokenizer; checks the texts agree.

3. A timeout timer per wait for a token (``loop.call_later`` + ``cancel``, what
   ``ReplyStream.next_batch`` did per token before it kept one timer per stream).
4. A mid-stream token on the direct path: ``ReplyStream.push`` -> ``DirectSink`` -> detokenizer ->
   SSE event -> the uvicorn cycle's transport (collecting, no syscall), the short way of a plain
   text delta (``SSEWriter.write_text``, since s39) against the long way (a ``ChoiceDelta`` through
   ``Format.chunks``); checks both wrote the same bytes.

Figures: process CPU microseconds per event/token, min over repeats (robust to other processes
on a shared machine, not to frequency scaling).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time

if sys.path and os.path.basename(sys.path[0]) == "bench":  # bench/gateway.py would shadow the package
    sys.path.pop(0)

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway import streaming

EVENT = ('data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764700000,'
         '"model":"tiny","choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}]}\n\n')


class Collect(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.out = bytearray()

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return False


def collecting_cycle() -> tuple[Collect, RequestResponseCycle]:
    """A real uvicorn httptools ``RequestResponseCycle`` of one streamed POST over a ``Collect``
    transport (what the gateway's ``send`` writes ends up in ``transport.out``)."""
    transport = Collect()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "http_version": "1.1"}
    cycle = RequestResponseCycle(scope, transport, FlowControl(transport), logging.getLogger("x"),
                                 logging.getLogger("y"), False, [], asyncio.Event(), False, True, lambda: None)
    return transport, cycle


async def one_response(n: int, direct: bool) -> bytes:
    transport, cycle = collecting_cycle()

    async def events():
        for _ in range(n):
            yield EVENT

    async def receive():
        await asyncio.Event().wait()

    send = cycle.send
    if direct:
        async def send(message, asgi=cycle.send, write=transport.write):
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and body and message.get("more_body"):
                write(b"%x\r\n%b\r\n" % (len(body), body))
            else:
                await asgi(message)
    await streaming.SSEResponse(events(), {})(cycle.scope, receive, send)
    return bytes(transport.out)


def detok_costs(model_dir: str, repeat: int) -> None:
    from tokenizers.decoders import DecodeStream

    from gateway.detok import IncrementalDetokenizer
    from mesh.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    rng = random.Random(0)
    seqs = [[rng.randrange(100, min(tok.vocab_size, 32000)) for _ in range(64)] for _ in range(300)]

    def ours() -> list[str]:
        out = []
        for s in seqs:
            d = IncrementalDetokenizer(tok)
            out.append("".join(d.push([t], final=i == len(s) - 1) for i, t in enumerate(s)))
        return out

    def decode_stream() -> list[str]:
        out = []
        for s in seqs:
            ds = DecodeStream(skip_special_tokens=True)
            out.append("".join(ds.step(tok._tok, t) or "" for t in s))
        return out

    assert ours() == decode_stream(), "the detokenizers disagree"
    for name, f in (("IncrementalDetokenizer", ours), ("DecodeStream", decode_stream)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            f()
            best = min(best, time.process_time() - t0)
        print(f"{name:22s} {best / (len(seqs) * 64) * 1e6:6.2f} us CPU per token (min of {repeat})")


async def sink_costs(model_dir: str, repeat: int) -> None:
    from types import SimpleNamespace

    from gateway.choice import ChoiceRun, RetryPolicy
    from gateway.direct import DirectSink
    from gateway.formats import ChatFormat
    from gateway.metrics import GatewayStats
    from gateway.replies import ReplyStream
    from gateway.service import _ChoiceText
    from mesh.protocol import TokenChunk
    from mesh.tokenizer import Tokenizer

    class LongWay(streaming.SSEWriter):
        __slots__ = ()

        def text_frame(self, index: int):
            return None

    tok = Tokenizer(model_dir)
    rng = random.Random(0)
    seqs = [[rng.randrange(100, min(tok.vocab_size, 32000)) for _ in range(64)] for _ in range(100)]
    stats = GatewayStats()
    loop = asyncio.get_running_loop()
    fmt = ChatFormat("chatcmpl-1", "tiny", None, [[1]], 1)  # one: its "created" is the same in both ways

    async def run(writer_type) -> tuple[bytes, float]:
        transport, cycle = collecting_cycle()
        await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
        owner = SimpleNamespace(prefix="_INBOX.bench", _streams={})
        chunks = [[TokenChunk("r", i, [t]) for i, t in enumerate(s)] for s in seqs]
        t0 = time.process_time()
        for seq in chunks:
            writer = writer_type(fmt, True)
            writer.attach(cycle.send)
            run = ChoiceRun(RetryPolicy())
            run.sent("w")
            run.streamed([], False)
            stream = ReplyStream(owner, "1", "w")
            stream.sink = DirectSink(writer, run, _ChoiceText(0, tok, [], 1), stats.choice_figures(stats.latency("t")))
            stream._waiter = loop.create_future()
            for c in seq:
                stream.push(c)
            assert stream.expect == len(seq), "a chunk went the reader's way"
        return bytes(transport.out), time.process_time() - t0

    assert (await run(LongWay))[0] == (await run(streaming.SSEWriter))[0], "the two ways wrote different bytes"
    for name, writer_type in (("direct, long way", LongWay), ("direct, short way", streaming.SSEWriter)):
        best = min([(await run(writer_type))[1] for _ in range(repeat)])
        print(f"{name:22s} {best / (len(seqs) * 64) * 1e6:6.2f} us CPU per token, push to transport (min of {repeat})")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/pdmesh-peers/tok32k"))
    a = ap.parse_args()
    assert await one_response(50, True) == await one_response(50, False), "the two paths wrote different bytes"
    for name, direct in (("asgi send", False), ("raw chunk writer", True)):
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.process_time()
            await one_response(a.events, direct)
            best = min(best, time.process_time() - t0)
        print(f"{name:22s} {best / a.events * 1e6:6.2f} us CPU per SSE event (min of {a.repeat} x {a.events})")
    loop, n = asyncio.get_running_loop(), a.events * 5
    best = float("inf")
    for _ in range(a.repeat):
        t0 = time.process_time()
        for _ in range(n):
            loop.call_later(60.0, print).cancel()
        best = min(best, time.process_time() - t0)
    print(f"{'call_later + cancel':22s} {best / n * 1e6:6.2f} us CPU per wait (min of {a.repeat} x {n})")
    if os.path.isdir(a.tokenizer):
        detok_costs(a.tokenizer, a.repeat)
        await sink_costs(a.tokenizer, a.repeat)


if __name__ == "__main__":
    import uvloop  # the gateway's loop

    uvloop.run(main())
