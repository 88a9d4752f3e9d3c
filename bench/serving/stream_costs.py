"""Microbenchmarks of the per-token costs of the gateway's streaming path (issue 33).

    python -m bench stream-costs [--events 20000] [--repeat 5] [--tokenizer DIR]

1. The ASGI layer per SSE event: ``gateway.streaming.SSEResponse`` over a real uvicorn httptools
   ``RequestResponseCycle`` whose transport only collects the bytes (no syscall: the Python cost
   alone), through ASGI ``send`` per event (what the gateway does) and through a raw writer of
   the same HTTP/1.1 chunks straight to the transport (what bypassing uvicorn would save); checks
   both wrote the same bytes.
2. Incremental detokenization per token: ``gateway.outputs.detok.IncrementalDetokenizer`` (a
   ``DecodeStream`` step per token since 2026-12-03; before, two decodes of a short window per
   push) against a bare ``tokenizers.decoders.DecodeStream``,
   on random 64-token streams of the side-by-side tokenizer (``--tokenizer``: the peers' tok32k
   when ``../shared/peers/dynamo_env.sh`` has built it, else the tiny model's); checks the texts agree.
3. A mid-stream token on the direct path: ``ReplyStream.push`` -> ``DirectSink`` -> detokenizer ->
   SSE event -> the uvicorn cycle's transport (collecting, no syscall), the short way of a plain
   text delta (``SSEWriter.write_text``) against the long way (a ``ChoiceDelta`` through
   ``Format.chunks``); checks both wrote the same bytes.

Figures: process CPU microseconds per event/token, min over repeats (robust to other processes
on a shared machine, not to frequency scaling).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import uvloop
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import generated
from gateway import streaming

BENCHMARK = Benchmark(
    name="stream-costs",
    measures="process CPU per token of the gateway's streaming path, in-process: the ASGI send per SSE event, "
             "incremental detokenization, and a mid-stream token from the bus batch to the socket (direct path)",
    minutes=0.5,
    smoke=("--events", "50", "--repeat", "1"),
)
PEERS_TOKENIZER = os.path.expanduser("~/.cache/pdmesh-peers/tok32k")

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


def random_streams(tok, rng: random.Random, n: int) -> list[list[int]]:
    """``n`` streams of 64 random token ids. A byte-level vocabulary (the tiny model's) has tokens
    that are part of a character: only tokens that are text on their own are drawn there, so that
    every stream is text and the detokenizers can be held to the same output."""
    top = min(tok.vocab_size, 32000)
    whole = [t for t in range(100, top) if "\ufffd" not in tok.decode([t])]
    if len(whole) == top - 100:  # every token is text on its own (the peers' WordPiece tok32k)
        return [[rng.randrange(100, top) for _ in range(64)] for _ in range(n)]
    return [[rng.choice(whole) for _ in range(64)] for _ in range(n)]


def detok_costs(model_dir: str, repeat: int) -> dict:
    from tokenizers.decoders import DecodeStream

    from gateway.outputs.detok import IncrementalDetokenizer
    from mesh.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    rng = random.Random(0)
    seqs = random_streams(tok, rng, 300)

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
    out = {}
    for name, f in (("IncrementalDetokenizer", ours), ("DecodeStream", decode_stream)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            f()
            best = min(best, time.process_time() - t0)
        out[name] = best / (len(seqs) * 64) * 1e6
        print(f"{name:22s} {out[name]:6.2f} us CPU per token (min of {repeat})")
    return out


async def sink_costs(model_dir: str, repeat: int) -> dict:
    from types import SimpleNamespace

    from gateway.choices.choice import ChoiceRun, RetryPolicy
    from gateway.choices.direct import DirectSink
    from gateway.choices.replies import ReplyStream
    from gateway.completions.formats import ChatFormat
    from gateway.metrics import GatewayStats
    from gateway.service import _ChoiceText
    from mesh.protocol import TokenChunk
    from mesh.tokenizer import Tokenizer

    class LongWay(streaming.SSEWriter):
        __slots__ = ()

        def text_frame(self, index: int):
            return None

    tok = Tokenizer(model_dir)
    rng = random.Random(0)
    seqs = random_streams(tok, rng, 100)
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
    out = {}
    for name, writer_type in (("direct, long way", LongWay), ("direct, short way", streaming.SSEWriter)):
        best = min([(await run(writer_type))[1] for _ in range(repeat)])
        out[name] = best / (len(seqs) * 64) * 1e6
        print(f"{name:22s} {out[name]:6.2f} us CPU per token, push to transport (min of {repeat})")
    return out


async def measure(a) -> dict:
    assert await one_response(50, True) == await one_response(50, False), "the two paths wrote different bytes"
    figures = {"us_per_event": {}, "tokenizer": a.tokenizer}
    for name, direct in (("asgi send", False), ("raw chunk writer", True)):
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.process_time()
            await one_response(a.events, direct)
            best = min(best, time.process_time() - t0)
        figures["us_per_event"][name] = best / a.events * 1e6
        print(f"{name:22s} {best / a.events * 1e6:6.2f} us CPU per SSE event (min of {a.repeat} x {a.events})")
    figures["us_per_token_detok"] = detok_costs(a.tokenizer, a.repeat)
    figures["us_per_token_direct"] = await sink_costs(a.tokenizer, a.repeat)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = parser(BENCHMARK, __doc__)
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer directory (default: the peers' tok32k if built, else the tiny model's)")
    a = parse(BENCHMARK, ap, argv)
    if a.tokenizer is None:
        a.tokenizer = PEERS_TOKENIZER if os.path.isdir(PEERS_TOKENIZER) else str(generated("tiny"))
    return emit(BENCHMARK, uvloop.run(measure(a)), a)  # the gateway's loop
