"""The gateway's failure paths and text handling, against workers that misbehave on purpose.

Cheap workers only: mocker processes (``mock``, and ``stuck``, which a test SIGSTOPs), and
two scripted decode workers that live in this test process and speak the worker protocol
(``mesh.protocol``) with canned token streams: multi-byte characters split across tokens, a
stop string across tokens, silence, gaps, garbage, worker errors, a draining worker. The
gateway under test is a real ``mesh gateway`` process with short timeouts; a second one
admits one request at a time (429), a third watches an empty namespace (503).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from mesh.bus import Bus
from mesh.protocol import Cancel, GenerateRequest, TokenChunk, TokenLogprobs, Usage, WorkerCard
from mesh.registry import CardPublisher
from mesh.tokenizer import Tokenizer
from tests.helpers.cluster import Watcher, wait_http_ok

SCRIPTED = "scripted"
TIMEOUT_S = 1.5
UTF8_TEXT = "héllo wörld, 你好 🎉 ñandú!"
STOP_TEXT = "alpha beta gamma delta epsilon " * 40


class ScriptedWorker:
    """A decode worker whose answers are scripts chosen by the prompt's text (see ``_play``)."""

    def __init__(self, nats_url: str, worker_id: str, tok: Tokenizer):
        self.nats_url, self.worker_id, self.tok = nats_url, worker_id, tok
        self.requests: list[GenerateRequest] = []
        self.cancels: list[str] = []
        self.sent: dict[str, int] = {}  # request id -> chunks sent
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> ScriptedWorker:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(15)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, self.worker_id)
        s = self.bus.subjects
        await self.bus.subscribe(s.generate(SCRIPTED, self.worker_id), self._on_generate, GenerateRequest)
        await self.bus.subscribe(s.cancel(SCRIPTED, self.worker_id), self._on_cancel, Cancel)
        self.cards = CardPublisher(self.bus, self._card)
        await self.cards.start()

    async def _stop(self) -> None:
        await self.cards.stop()
        await self.bus.close()

    def _card(self) -> WorkerCard:
        now = time.time()
        return WorkerCard(self.worker_id, "decode", SCRIPTED, 16, 1024, 16384, socket.gethostname(), os.getpid(),
                          now, now, engine="scripted")

    async def _on_cancel(self, msg: Cancel, raw) -> None:
        self.cancels.append(msg.request_id)

    async def _on_generate(self, req: GenerateRequest, raw) -> None:
        self.requests.append(req)
        self.loop.create_task(self._play(req, raw.reply))

    async def _send(self, reply: str, chunk: TokenChunk) -> None:
        self.sent[chunk.request_id] = self.sent.get(chunk.request_id, 0) + 1
        await self.bus.publish(reply, chunk)

    async def _play(self, req: GenerateRequest, reply: str) -> None:
        script = self.tok.decode(req.token_ids).strip()
        rid, n_prompt = req.request_id, len(req.token_ids)
        if script == "retry" and self.worker_id.endswith("-a"):
            await self._send(reply, TokenChunk(rid, 0, finish_reason="error", error="worker is draining",
                                               error_status=503, worker=self.worker_id))
            return
        if script == "bad":
            await self._send(reply, TokenChunk(rid, 0, finish_reason="error", error="prompt rejected by the engine",
                                               error_status=400, worker=self.worker_id))
            return
        if script == "crash":
            await self._send(reply, TokenChunk(rid, 0, finish_reason="error", error="engine exploded",
                                               error_status=500, worker=self.worker_id))
            return
        if script == "garbage":
            await self.bus.nc.publish(reply, b"\xc1 not msgpack")
            return
        text = {"utf8": UTF8_TEXT, "stop": STOP_TEXT}.get(script, "fine, thanks")
        ids = self.tok.encode(text, add_special_tokens=False)
        for i, t in enumerate(ids):
            if rid in self.cancels:
                return
            if script.startswith("stall") and i == 2:
                return  # silence, forever (a resumed "stall" request stalls again)
            index = i + 1 if script == "gap" and i >= 1 else i
            last = i == len(ids) - 1
            usage = Usage(n_prompt, i + 1, 16) if i == 0 or last else None
            k = req.sampling.logprobs
            lps = [] if k is None else [TokenLogprobs(-0.25, [t, 7][:k], [-0.25, -3.0][:k])]
            await self._send(reply, TokenChunk(rid, index, [t], lps, finish_reason="length" if last else None,
                                               usage=usage, worker=self.worker_id))
            await asyncio.sleep(0.01 if script == "stop" else 0.002)


@dataclass(frozen=True)
class Mesh:
    url: str  # short timeouts; knows the tiny tokenizer as "tiny" (no worker) and as "scripted"
    limited_url: str  # --max-inflight 1
    empty_url: str  # a namespace with no workers at all
    nats_url: str
    stuck: object  # the Popen of the mock worker "stuck"
    scripted: tuple[ScriptedWorker, ScriptedWorker]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def mesh(cluster, tiny_model, tok):
    cluster.worker("mock", "--served-name", "mock", "--worker-id", "mock-0")
    stuck = cluster.worker("mock", "--served-name", "stuck", "--worker-id", "stuck-0")
    scripted = (ScriptedWorker(cluster.nats_url, "scripted-a", tok).start(),
                ScriptedWorker(cluster.nats_url, "scripted-b", tok).start())
    timeouts = ["--first-token-timeout", str(TIMEOUT_S), "--idle-timeout", str(TIMEOUT_S)]
    # the tiny tokenizer under three names: "tiny" (no worker ever), "scripted", "stuck"
    url = cluster.gateway(tiny_model, None, "--model", str(tiny_model), "--model", str(tiny_model),
                          "--served-name", "tiny", "--served-name", SCRIPTED, "--served-name", "stuck", *timeouts,
                          "--router", "round-robin")  # the draining test relies on alternation
    limited = cluster.gateway(tiny_model, None, "--max-inflight", "1")
    empty = cluster.gateway(tiny_model, None, "--ns", "empty")

    async def ready():
        w = await Watcher.open(cluster.nats_url)
        try:
            await w.wait_for(lambda: all(w.membership.get(x) for x in ("mock-0", "stuck-0", "scripted-a",
                                                                       "scripted-b")), 60, "workers")
        finally:
            await w.close()

    asyncio.run(ready())
    for u in (url, limited):
        wait_http_ok(u + "/health", 60)
    wait_http_ok(empty + "/live", 60)
    yield Mesh(url, limited, empty, cluster.nats_url, stuck, scripted)
    for s in scripted:
        s.stop()


def assert_error(r: httpx.Response, status: int, kind: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    if kind:
        assert err["type"] == kind, err
    assert contains in err["message"], err
    assert "Traceback" not in r.text
    return err


def events(raw: str) -> list:
    out = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in out]


# -- 503, 429, 504 -------------------------------------------------------------------------------


async def test_no_live_worker_is_503(mesh):
    async with httpx.AsyncClient() as http:
        # the gateway knows the model (it has its tokenizer) but no worker serves it
        r = await http.post(mesh.url + "/v1/chat/completions",
                            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert_error(r, 503, "service_unavailable", "no live worker")
        # a namespace with no workers at all: not ready, no models, every request 503
        assert (await http.get(mesh.empty_url + "/health")).status_code == 503
        assert (await http.get(mesh.empty_url + "/v1/models")).json()["data"] == []
        r = await http.post(mesh.empty_url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert_error(r, 503, "service_unavailable")


async def test_admission_limit_is_429_with_retry_after(mesh):
    body = {"model": "mock", "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=mesh.limited_url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            lines = held.aiter_lines()
            await anext(lines)
            r = await http.post("/v1/completions", json={"model": "mock", "prompt": [1, 2], "max_tokens": 2})
            assert_error(r, 429, "rate_limit_error")
            assert r.headers["retry-after"] == "1"
            client = openai.AsyncOpenAI(base_url=mesh.limited_url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model="mock", prompt=[1, 2], max_tokens=2)
        # the held stream is gone: its slot comes back
        deadline = time.monotonic() + 10
        while True:
            r = await http.post("/v1/completions", json={"model": "mock", "prompt": [1, 2], "max_tokens": 2})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200, r.text


async def test_silent_worker_is_504_then_503_once_it_expires(mesh):
    os.kill(mesh.stuck.pid, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
            body = {"model": "stuck", "prompt": [5, 6, 7], "max_tokens": 4}
            t0 = time.monotonic()
            # the first-token timeout answered (its own value in the message), not any later one
            assert_error(await http.post("/v1/completions", json=body), 504, "timeout_error",
                         f"sent nothing for {TIMEOUT_S:g}s")
            assert time.monotonic() - t0 >= TIMEOUT_S  # and not before it
            # streaming too: no first token, so a real HTTP status rather than a 200 stream
            assert_error(await http.post("/v1/completions", json={**body, "stream": True}), 504, "timeout_error")
            # the stopped worker's card expires (registry TTL): the gateway knows "stuck" (it has
            # its tokenizer), but nothing serves it now
            deadline = time.monotonic() + 30
            while (r := await http.post("/v1/completions", json=body)).status_code == 504:
                assert time.monotonic() < deadline, "the stopped worker never left the registry"
            # the request in flight when the card expired learns its worker went away (nowhere to resume)
            assert_error(r, 503, "service_unavailable")
            assert_error(await http.post("/v1/completions", json=body), 503, "service_unavailable", "no live worker")
    finally:
        os.kill(mesh.stuck.pid, signal.SIGKILL)


async def test_stream_that_goes_silent_is_resumed_then_ends_with_a_timeout_event(mesh, tok):
    for w in mesh.scripted:
        w.requests.clear()
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        t0 = time.monotonic()
        r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": "stall", "stream": True})
    assert r.status_code == 200  # two tokens came: the stream had started
    assert time.monotonic() - t0 >= 2 * TIMEOUT_S
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    err = evs[-2]["error"]
    assert err["type"] == "timeout_error" and "sent nothing" in err["message"]
    # the first worker went silent after two tokens: the stream was resumed on the other one, with
    # the prompt plus those two tokens and an output offset of two; that one stalled too, and
    # there was no third worker to try
    asked = [r for w in mesh.scripted for r in w.requests]
    assert len(asked) == 2
    original, resumed = sorted(asked, key=lambda r: r.output_offset)
    assert resumed.output_offset == 2 and resumed.token_ids[:-2] == original.token_ids
    assert resumed.sampling.max_tokens == original.sampling.max_tokens - 2
    streamed = "".join(e["choices"][0]["text"] for e in evs[:-2])
    two = tok.decode(tok.encode("fine, thanks", add_special_tokens=False)[:2])
    assert streamed == two + two


# -- text ------------------------------------------------------------------------------------------


async def test_multibyte_characters_split_across_tokens_stream_whole(mesh, tok):
    ids = tok.encode(UTF8_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the script really splits characters
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": "utf8", "stream": True,
                                                     "stream_options": {"include_usage": True}})
        evs = events(r.text)
        texts = [e["choices"][0]["text"] for e in evs[:-2]]
        assert all("\ufffd" not in t for t in texts), texts
        assert "".join(texts) == UTF8_TEXT
        assert len([t for t in texts if t]) > 5  # it did stream, piece by piece
        usage = evs[-2]["usage"]
        assert usage["completion_tokens"] == len(ids) and usage["prompt_tokens_details"]["cached_tokens"] == 16
        r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": "utf8", "logprobs": 1})
        choice = r.json()["choices"][0]
        assert choice["text"] == UTF8_TEXT
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["text_offset"]) == len(ids)
        # a token that is part of a character is named by its bytes, as OpenAI names it
        assert any(t.startswith("bytes:\\x") for t in lp["tokens"])
        # offsets are character positions in the text: the first token of each character points at it
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(UTF8_TEXT)
        whole = [(t, o) for t, o in zip(lp["tokens"], offsets, strict=True) if not t.startswith("bytes:")]
        assert all(UTF8_TEXT[o:].startswith(t) for t, o in whole)
        r = await http.post("/v1/chat/completions", json={
            "model": SCRIPTED, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert b"".join(bytes(t["bytes"]) for t in content).decode() == r.json()["choices"][0]["message"]["content"]


async def test_stop_string_across_tokens_is_cut_and_cancels_the_worker(mesh, tok):
    stop = "a gam"  # "alpha beta gamma": ends inside "beta", starts after it, ends inside "gamma"
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    assert all(stop not in tok.decode([t]) for t in ids)
    worker_cancels = lambda: sum(len(s.cancels) for s in mesh.scripted)  # noqa: E731
    for stream in (False, True):
        before = worker_cancels()
        async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": "stop", "stop": stop,
                                                         "stream": stream})
        if stream:
            evs = events(r.text)
            text = "".join(e["choices"][0]["text"] for e in evs[:-1])
            reason = evs[-2]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (text, reason) == ("alpha bet", "stop")
        deadline = time.monotonic() + 5
        while worker_cancels() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert worker_cancels() == before + 1  # the rest of the 200 tokens is not generated for nothing


# -- worker failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "status", "contains"), [
    ("bad", 400, "prompt rejected"),
    ("crash", 502, "engine exploded"),
    ("gap", 502, "skipped chunk"),
    ("garbage", 502, "malformed"),
])
async def test_worker_failures_map_to_statuses(mesh, script, status, contains):
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": script, "max_tokens": 50})
        assert_error(r, status, None, contains)
        r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": script, "stream": True})
        if script == "gap":  # the first chunk was fine: the stream started, then ends with the error
            evs = events(r.text)
            assert evs[-2]["error"]["type"] == "upstream_error" and evs[-1] == "[DONE]"
        else:
            assert_error(r, status, None, contains)


async def test_a_draining_worker_is_retried_elsewhere(mesh):
    a = mesh.scripted[0]
    seen = len([q for q in a.requests if q.request_id])
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        for _ in range(2):  # round robin: one of the two goes to scripted-a first
            r = await http.post("/v1/completions", json={"model": SCRIPTED, "prompt": "retry"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fine, thanks"
    assert len(a.requests) > seen


async def test_oversized_body_is_413_and_other_methods_keep_the_error_shape(mesh):
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        r = await http.post("/v1/completions", content=b" " * ((32 << 20) + 1))
        assert_error(r, 413, "invalid_request_error", "request body is over")
        assert_error(await http.get("/v1/completions"), 405)
        assert_error(await http.get("/v2/nothing"), 404, "not_found_error")
        metrics = (await http.get("/metrics")).text
    assert 'pdmesh_gateway_requests_total{endpoint="completions",status="413"} 1' in metrics
    assert 'pdmesh_gateway_requests_total{endpoint="completions",status="200"}' in metrics
    assert "pdmesh_gateway_cancels_total" in metrics


async def test_a_model_without_a_tokenizer_takes_token_ids_only(mesh):
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        r = await http.post("/v1/chat/completions", json={"model": "mock", "messages": [{"role": "user", "content": "x"}]})
        assert_error(r, 400, "invalid_request_error", "no tokenizer")
        assert_error(await http.post("/v1/completions", json={"model": "mock", "prompt": "text"}), 400)
        r = await http.post("/v1/completions", json={"model": "mock", "prompt": [1, 2, 3], "max_tokens": 4,
                                                     "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and len(choice["token_ids"]) == 4 and choice["text"] == ""
        # the worker knows its vocabulary even when the gateway does not
        r = await http.post("/v1/completions", json={"model": "mock", "prompt": [10**9], "max_tokens": 1})
        assert_error(r, 400, "invalid_request_error", "outside the vocabulary")
