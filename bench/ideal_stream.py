"""A streaming server that costs next to nothing: the floor under any server's chunk-gap figures.

It answers ``POST /v1/chat/completions`` (any body) with an OpenAI-shaped SSE stream of ``T`` tokens
and ``GET /v1/models``. Streams go round-robin to ``WORKERS`` (2, as the
harness runs) simulated workers, each stepping every ``STEP_MS`` on its own clock (their phases
apart, as independent workers drift); a step writes the next chunk of each of its open streams:
pre-rendered bytes, one write per stream per step, no batching across steps, no detokenizer, no
bus. A stream's first token (with the role, as a separate event) leaves at the first step after
its request; the last carries the finish, usage and ``[DONE]`` events. So what a client measures
against it is the client itself plus the step time: ``bench/gap_floor.sh`` runs it beside pdmesh and
Dynamo with the side-by-side harness's client.

    python bench/ideal_stream.py PORT STEP_MS [TOKENS] [WORKERS]
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvloop


def _event(obj: dict) -> bytes:
    body = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(body), body)


def _events(tokens: int) -> tuple[bytes, bytes, bytes]:
    """(role, token, end): the chunked-encoding bytes of the role event (before a stream's first
    token), of one token's event, and of the finish, usage and ``[DONE]`` events (after its last)."""
    base = {"id": "chatcmpl-ideal", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}

    def chunk(delta: dict, finish=None) -> bytes:
        return _event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                       "usage": None})

    usage = _event({**base, "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": tokens,
                                                     "total_tokens": 100 + tokens}})
    done = b"data: [DONE]\n\n"
    end = chunk({}, "length") + usage + b"%x\r\n%b\r\n" % (len(done), done) + b"0\r\n\r\n"
    return chunk({"role": "assistant", "content": ""}), chunk({"content": " tok123"}), end


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()


class _Http(asyncio.Protocol):
    """Keep-alive HTTP/1.1, requests with a Content-Length body (what httpx sends)."""

    def __init__(self, workers: list[list]):
        self.workers = workers
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1")
            size = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    size = int(value)
            if len(self.buf) < end + 4 + size:
                return
            self.buf = self.buf[end + 4 + size:]
            if head.startswith("GET"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n%b" % (len(_MODELS), _MODELS))
            else:
                self.transport.write(_HEAD)
                w = self.workers
                w.append(w.pop(0))  # round-robin (the list is shared; the workers keep their own queues)
                w[-1].append([self.transport, 0])


async def _serve(port: int, step_s: float, tokens: int, workers: int) -> None:
    loop = asyncio.get_running_loop()
    queues: list[list] = [[] for _ in range(workers)]
    await loop.create_server(lambda: _Http(queues), "127.0.0.1", port)
    print(f"ideal stream server on 127.0.0.1:{port}: {workers} workers, a step every {step_s * 1000:g} ms",
          flush=True)
    await asyncio.gather(*(_worker(q, step_s, tokens, loop.time() + step_s * k / workers) for k, q in enumerate(queues)))


async def _worker(streams: list, step_s: float, tokens: int, due: float) -> None:
    role, token, end = _events(tokens)
    loop = asyncio.get_running_loop()
    while True:
        due += step_s
        await asyncio.sleep(max(0.0, due - loop.time()))
        kept = []
        for s in streams:
            transport, sent = s
            if transport.is_closing():
                continue
            s[1] = sent = sent + 1
            ended = sent >= tokens
            transport.write((role if sent == 1 else b"") + token + (end if ended else b""))  # one write a step
            if not ended:
                kept.append(s)
        streams[:] = kept


def main() -> None:
    try:
        port, step_ms = int(sys.argv[1]), float(sys.argv[2])
        tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
        workers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    except (IndexError, ValueError):
        sys.exit("usage: python bench/ideal_stream.py PORT STEP_MS [TOKENS] [WORKERS]")
    uvloop.run(_serve(port, step_ms / 1000.0, tokens, workers))


if __name__ == "__main__":
    main()
