"""``gateway.choices.direct.DirectSink`` writes a choice's mid-stream tokens from the reply handler: the
bytes on the client's connection must be those of the ASGI way (every delta through
``Format.chunks`` and uvicorn's ``send``), on its short way (plain text) and its long one."""

from __future__ import annotations

import pytest

from bench.serving.stream_costs import collecting_cycle
from gateway.choices.choice import ChoiceRun, ChoiceState, RetryPolicy
from gateway.choices.direct import DirectSink
from gateway.completions.formats import ChatFormat, CompletionFormat
from gateway.metrics import GatewayStats
from gateway.service import _ChoiceText
from gateway.streaming import SSEWriter
from mesh.protocol import TokenChunk, TokenLogprobs
from mesh.tokenizer import Tokenizer

# multi-byte characters split over tokens, quotes and backslashes to escape
TEXT = 'héllo 你好 🙂 "q" \\ end'


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


FORMATS = {
    "chat": lambda: ChatFormat("chatcmpl-1", "tiny", None, [[1, 2]], 1),
    "chat_usage": lambda: ChatFormat("chatcmpl-1", "tiny", None, [[1, 2]], 1, include_usage=True),
    "chat_token_ids": lambda: ChatFormat("chatcmpl-1", "tiny", None, [[1, 2]], 1, return_token_ids=True),
    "completion_echo": lambda: CompletionFormat("cmpl-1", "tiny", None, [[1, 2]], 1, echo_texts=["hi"]),
}


async def stream(tok, make_format, chunks: list[TokenChunk], direct: bool) -> tuple[bytes, SSEWriter]:
    """The body bytes of one choice's events; ``direct``: its middle chunks through a ``DirectSink``."""
    fmt = make_format()
    transport, cycle = collecting_cycle()
    await cycle.send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    del transport.out[:]
    writer = SSEWriter(fmt, True)
    writer.attach(cycle.send)
    assert writer.ready()
    text, run = _ChoiceText(0, tok, [], 2), ChoiceRun(RetryPolicy())
    run.sent("w")
    sink = DirectSink(writer, run, text, GatewayStats().choice_figures(GatewayStats().latency("tiny")))

    async def indirect(chunk: TokenChunk) -> None:  # what Gateway.stream_choice and sse_events do
        delta = text.delta([chunk])
        run.streamed(delta.token_ids, delta.finish_reason is not None)
        if out := fmt.chunks(delta, True):
            await cycle.send({"type": "http.response.body", "body": out.encode(), "more_body": True})

    for i, c in enumerate(chunks):
        if direct and 0 < i < len(chunks) - 1:
            assert run.state is ChoiceState.STREAMING
            assert sink(c)
        else:
            await indirect(c)
    return bytes(transport.out), writer


@pytest.mark.parametrize("name", list(FORMATS))
async def test_the_direct_way_writes_the_bytes_of_the_asgi_way(tok, name):
    ids = tok.encode(TEXT)
    chunks = [TokenChunk("r", i, [t], finish_reason="length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    want, _ = await stream(tok, FORMATS[name], chunks, direct=False)
    got, writer = await stream(tok, FORMATS[name], chunks, direct=True)
    assert got == want
    assert TEXT.encode("ascii", "backslashreplace") not in got and b"\\ud83d\\ude42" in got  # JSON-escaped
    # plain text went the short way; token ids in every event, the long one
    assert (writer.frame is None) == (name == "chat_token_ids")


async def test_logprobs_and_usage_take_the_long_way_with_the_same_bytes(tok):
    ids = tok.encode("hello world, again")
    lp = TokenLogprobs(-0.5, [ids[0]], [-0.5])
    chunks = [TokenChunk("r", i, [t], logprobs=[lp] if i == 2 else [], finish_reason="length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    fmt = FORMATS["chat"]
    want, _ = await stream(tok, fmt, chunks, direct=False)
    got, _ = await stream(tok, fmt, chunks, direct=True)
    assert got == want and b'"logprobs":{"content"' in got
