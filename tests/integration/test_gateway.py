"""The OpenAI-compatible gateway on a real mesh, driven by the official ``openai`` client.

One cluster for the module: a nats-server, two decode workers on the tiny model (``dec-disagg``
sends prompts of >= 32 uncached tokens to the prefill worker; ``dec-local`` prefills
everything itself), one prefill worker, and the gateway. Round-robin alternates requests
between the two decode workers, so every equality check below covers both paths. The
reference is the in-process engine, which is what ``mesh generate`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.tokenizer import Tokenizer
from tests.helpers.cluster import Watcher, wait_http_ok

DISAGG_THRESHOLD = 32
DECODE_WORKERS = ("dec-disagg", "dec-local")


@dataclass(frozen=True)
class Mesh:
    url: str  # the gateway
    nats_url: str


@asynccontextmanager
async def watching(mesh: Mesh):
    w = await Watcher.open(mesh.nats_url)
    try:
        yield w
    finally:
        await w.close()


@pytest.fixture(scope="module")
def mesh(cluster, tiny_model) -> Mesh:
    flags = ["--model", str(tiny_model), "--device-kv-blocks", "512"]
    cluster.worker("decode", *flags, "--disagg-threshold", str(DISAGG_THRESHOLD), "--worker-id", "dec-disagg")
    cluster.worker("decode", *flags, "--disagg-threshold", "100000", "--worker-id", "dec-local")
    cluster.worker("prefill", *flags, "--worker-id", "pre-0", "--prefill-capacity", "8")
    url = cluster.gateway(tiny_model, None, "--router", "round-robin")  # tests rely on alternation

    async def ready():
        w = await Watcher.open(cluster.nats_url)
        try:
            await w.wait_for(lambda: all(w.membership.get(x) for x in (*DECODE_WORKERS, "pre-0")), 120, "workers")
            await w.fresh_load("pre-0")  # the disaggregating decode worker has heard the prefill pool's load
        finally:
            await w.close()

    asyncio.run(ready())
    wait_http_ok(url + "/health", 60)
    return Mesh(url, cluster.nats_url)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model, num_kv_blocks=1024))


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="x", max_retries=0, timeout=120)


def reference(engine, prompts: list[list[int]], **sampling) -> list[list[int]]:
    params = SamplingParams(**{"temperature": 0.0, **sampling})
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def extra(obj, name: str):
    """A field the openai types do not declare (our vLLM-style ``token_ids``)."""
    return (obj.model_extra or {}).get(name)


async def sse_events(http: httpx.AsyncClient, path: str, body: dict) -> list[dict | str]:
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert all(not e.startswith("data: ") for e in events)
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


# -- discovery ---------------------------------------------------------------------------------


async def test_models_health_and_metrics(mesh, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert extra(models.data[0], "max_model_len") == 512 * 16
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["models"] == ["tiny"]
        metrics = (await http.get("/metrics")).text
    assert 'pdmesh_gateway_live_workers{model="tiny"} 2' in metrics
    assert "pdmesh_gateway_inflight_requests" in metrics


async def test_sse_framing_is_openais(mesh):
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as http:
        evs = await sse_events(http, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}})
        assert evs[-1] == "[DONE]"
        chunks = evs[:-1]
        assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
        assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]
        content = chunks[1:-2]
        assert content and all(set(c["choices"][0]["delta"]) == {"content"} and c["usage"] is None for c in content)
        assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        # completions: no role chunk; the finish reason rides on the last text chunk; no usage unless asked
        evs = await sse_events(http, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                         "ignore_eos": True, "stream": True})
        assert evs[-1] == "[DONE]" and all("usage" not in c for c in evs[:-1])
        assert [c["choices"][0]["finish_reason"] for c in evs[:-1]][-1] == "length"
        assert all(c["object"] == "text_completion" for c in evs[:-1])


# -- outputs equal the engine's ----------------------------------------------------------------


async def test_chat_greedy_equals_engine_streaming_and_not(client, engine, tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    prompt = tok.encode_chat([{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                               else "".join(p["text"] for p in m["content"])} for m in messages])
    (want,) = reference(engine, [prompt], max_tokens=12, ignore_eos=True)
    r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    (choice,) = r.choices
    assert extra(choice, "token_ids") == want
    assert choice.message.role == "assistant" and choice.message.content == tok.decode(want)
    assert choice.finish_reason == "length"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 12, len(prompt) + 12)

    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert {c.id for c in chunks} == {chunks[0].id}
    body = chunks[1:-1]
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == tok.decode(want)
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    last = body[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(prompt)


async def test_completions_text_prompts_equal_engine(client, engine, tok):
    texts = ["The mesh routes each request", "Once upon a time"]
    prompts = [tok.encode(t) for t in texts]
    want = reference(engine, prompts, max_tokens=10, ignore_eos=True)
    r = await client.completions.create(model="tiny", prompt=texts, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c, p, w in zip(r.choices, prompts, want, strict=True):
        assert extra(c, "token_ids") == w and c.text == tok.decode(w) and c.finish_reason == "length"
        assert extra(c, "prompt_token_ids") == p
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 20

    stream = await client.completions.create(model="tiny", prompt=texts[0], max_tokens=10, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(want[0])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


async def test_token_id_prompts_and_echo(client, engine, tok):
    one, two = random_ids(20, 1), random_ids(9, 2)
    want = reference(engine, [one, two], max_tokens=8, ignore_eos=True)
    r = await client.completions.create(model="tiny", prompt=one, max_tokens=8, temperature=0, echo=True,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == want[0]
    assert r.choices[0].text == tok.decode(one) + tok.decode(want[0])
    assert r.usage.prompt_tokens == 20
    r = await client.completions.create(model="tiny", prompt=[one, two], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [extra(c, "token_ids") for c in r.choices] == want
    assert r.usage.prompt_tokens == 29 and r.usage.completion_tokens == 16


async def test_disaggregated_prefill_outputs_equal_engine(mesh, client, engine):
    prompts = [random_ids(n, 100 + n) for n in (40, 90, 150, 260)]
    want = reference(engine, prompts, max_tokens=8, ignore_eos=True)
    async with watching(mesh) as watch:
        before = {x: (await watch.fresh_load(x)).counters for x in DECODE_WORKERS}
        # each prompt twice: round-robin puts one of each pair on each decode worker
        results = await asyncio.gather(*(
            client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
            for p in prompts for _ in range(2)))
        after = {x: (await watch.fresh_load(x)).counters for x in DECODE_WORKERS}
    for i, r in enumerate(results):
        assert extra(r.choices[0], "token_ids") == want[i // 2], f"prompt {i // 2} differs"
    remote = after["dec-disagg"].get("remote_prefill_done", 0) - before["dec-disagg"].get("remote_prefill_done", 0)
    assert remote >= 1, after["dec-disagg"]  # long prompts really crossed from the prefill worker
    for x in DECODE_WORKERS:  # and the round robin used both decode workers
        assert after[x]["requests"] - before[x]["requests"] >= 2


async def test_repeated_prompt_reports_cached_tokens(client):
    prompt = random_ids(100, 7)
    cached = []
    for _ in range(3):  # at least two land on the same decode worker
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.usage.prompt_tokens == 100
    assert cached[0] == 0 and max(cached) >= 96, cached  # six full blocks of 16


async def test_n2_choices_and_usage(client, engine, tok):
    prompt = "Tell me about routers"
    (want,) = reference(engine, [tok.encode(prompt)], max_tokens=6, ignore_eos=True)
    r = await client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [tok.decode(want)] * 2
    assert r.usage.prompt_tokens == len(tok.encode(prompt))  # once, not once per choice
    assert r.usage.completion_tokens == 12

    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], n=2, max_tokens=6, temperature=2.0,
        seed=5, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finished, roles = {0: "", 1: ""}, set(), set()
    async for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles |= {ch.index} if ch.delta.role == "assistant" else set()
            finished |= {ch.index} if ch.finish_reason else set()
        if not c.choices:
            assert c.usage.completion_tokens == 12
    assert roles == finished == {0, 1}
    assert texts[0] != texts[1]  # choice k is seeded with seed + k


async def test_seeded_sampling_is_reproducible_and_equals_engine(client, engine, tok):
    prompt = random_ids(12, 3)
    kw = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 50, "min_p": 0.01})
    a = await client.completions.create(seed=1234, **kw)
    b = await client.completions.create(seed=1234, **kw)
    c = await client.completions.create(seed=99, **kw)
    ids = [extra(x.choices[0], "token_ids") for x in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    (want,) = reference(engine, [prompt], max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                        seed=1234, ignore_eos=True)
    assert ids[0] == want


async def test_penalties_reach_the_sampler(client, engine):
    prompt = random_ids(10, 11)
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.0)
    (plain,) = reference(engine, [prompt], max_tokens=24, ignore_eos=True)
    (want,) = reference(engine, [prompt], max_tokens=24, ignore_eos=True, repetition_penalty=1.3, **penalties)
    assert want != plain  # the penalties change this output, so the check below means something
    r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, **penalties,
                                        extra_body={"ignore_eos": True, "return_token_ids": True,
                                                    "repetition_penalty": 1.3})
    assert extra(r.choices[0], "token_ids") == want


async def test_tiny_temperature_is_greedy_not_a_crash(client, engine):
    prompt = random_ids(10, 4)
    (want,) = reference(engine, [prompt], max_tokens=6, ignore_eos=True)
    r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1e-300,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == want


# -- stops -------------------------------------------------------------------------------------


def _spanning_stop(tok, ids: list[int]) -> tuple[str, str]:
    """A stop string that starts inside one token and ends inside a later one, and the text before it."""
    text = tok.decode(ids)
    bounds = [len(tok.decode(ids[:k])) for k in range(1, len(ids))]
    for b in bounds[3:]:
        start, end = b - 1, b + 2
        stop = text[start:end]
        if len(stop) == 3 and text.find(stop) == start and stop.strip() == stop:
            return stop, text[:start]
    raise AssertionError("no usable stop string in " + repr(text))


async def test_stop_string_spanning_tokens(client, engine, tok):
    prompt = random_ids(15, 5)
    (want,) = reference(engine, [prompt], max_tokens=30, ignore_eos=True)
    stop, before = _spanning_stop(tok, want)
    kw = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@never@@"],
              extra_body={"ignore_eos": True})
    r = await client.completions.create(**kw)
    assert r.choices[0].text == before and r.choices[0].finish_reason == "stop"
    stream = await client.completions.create(stream=True, **kw)
    pieces = [c.choices[0] async for c in stream]
    assert "".join(p.text for p in pieces) == before  # no part of the stop string ever went out
    assert pieces[-1].finish_reason == "stop"

    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True})
    text = chat.choices[0].message.content
    stop = text[5:8]
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30, temperature=0, stop=stop,
        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == text[: text.find(stop)]
    assert chat.choices[0].finish_reason == "stop"


async def test_stop_token_ids(client, engine):
    prompt = random_ids(10, 6)
    (want,) = reference(engine, [prompt], max_tokens=12, ignore_eos=True)
    stop_at = want[4]
    r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [stop_at],
                                                    "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop"
    assert extra(r.choices[0], "token_ids") == want[: want.index(stop_at) + 1]


async def test_min_tokens_holds_back_stop_ids(client, engine):
    """vLLM's ``min_tokens`` (load generators send it with ``ignore_eos``): a stop id the model
    would draw first cannot be drawn, nor end the output, before it."""
    prompt = random_ids(10, 7)
    (want,) = reference(engine, [prompt], max_tokens=8, ignore_eos=True)
    body = {"ignore_eos": True, "stop_token_ids": [want[0]], "return_token_ids": True}
    r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={**body, "min_tokens": 8})
    ids = extra(r.choices[0], "token_ids")
    assert r.choices[0].finish_reason == "length" and len(ids) == 8 and want[0] not in ids


# -- logprobs ----------------------------------------------------------------------------------


async def test_chat_logprobs_match_tokens_and_engine(client, engine, tok):
    messages = [{"role": "user", "content": "Count to three"}]
    prompt = tok.encode_chat(messages)
    ref = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t, tid, lp in zip(content, ref.output_token_ids, ref.output_logprobs, strict=True):
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert t.logprob == pytest.approx(lp.logprob, abs=1e-3)
        assert bytes(t.bytes) == b"".join(bytes(x) for x in [t.bytes])
        assert tok.decode([tid]) in (t.token, "\ufffd") or t.token.startswith("bytes:")
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)

    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                  logprobs=True, top_logprobs=3, stream=True,
                                                  extra_body={"ignore_eos": True})
    streamed = [t async for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, round(t.logprob, 3)) for t in streamed] == [(t.token, round(t.logprob, 3)) for t in content]


async def test_completion_logprobs(client):
    r = await client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0,
                                        logprobs=2, echo=False, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


# -- cancellation ------------------------------------------------------------------------------


async def _idle(watch: Watcher) -> dict[str, dict]:
    """Wait until every decode worker reports nothing running and no KV block in use."""
    def all_idle():
        reports = {x: watch.loads.get(x) for x in DECODE_WORKERS}
        return all(r and r.running == 0 and r.waiting == 0 and r.kv_blocks_used == 0 for r in reports.values())

    for x in DECODE_WORKERS:
        await watch.fresh_load(x)
    await watch.wait_for(all_idle, 30, "decode workers idle with every KV block free")
    return {x: dict(watch.loads[x].counters) for x in DECODE_WORKERS}


async def test_client_disconnect_mid_stream_frees_the_worker(mesh):
    async with watching(mesh) as watch:
        before = await _idle(watch)
        body = {"model": "tiny", "prompt": random_ids(60, 8), "max_tokens": 6000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # held, not broken out of: dropping it would close the connection now
            seen = 0
            while seen < 2:
                seen += (await anext(lines)).startswith("data: ")
            # still generating: some decode worker holds the request and its blocks
            busy = await watch.wait_for(
                lambda: [x for x in DECODE_WORKERS if (rep := watch.loads.get(x)) and rep.running == 1
                         and rep.kv_blocks_used > 0], 10, "the request running on a worker")
        # leaving the block closed the connection mid-stream
        after = await _idle(watch)
        (worker,) = busy
        assert after[worker]["cancelled"] == before[worker]["cancelled"] + 1
        assert after[worker]["finished"] == before[worker]["finished"]  # it never ran to the end
        async with httpx.AsyncClient(base_url=mesh.url) as http:
            assert "pdmesh_gateway_inflight_requests 0" in (await http.get("/metrics")).text


async def test_client_disconnect_while_waiting_for_a_whole_response(mesh):
    async with watching(mesh) as watch:
        before = await _idle(watch)
        body = {"model": "tiny", "prompt": random_ids(30, 9), "max_tokens": 4000, "ignore_eos": True, "n": 2}
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as http:
            # the client leaves once both choices run on workers (a fixed client timeout raced the
            # second choice reaching its worker: then only one was there to cancel)
            post = asyncio.ensure_future(http.post("/v1/completions", json=body))
            try:
                await watch.wait_for(lambda: sum(watch.loads[x].running for x in DECODE_WORKERS if x in watch.loads) == 2,
                                     30, "both choices running on workers")
                assert not post.done()  # a whole response of 2 x 4000 tokens is still being made
            finally:
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await post
        after = await _idle(watch)
        cancelled = sum(after[x]["cancelled"] - before[x]["cancelled"] for x in DECODE_WORKERS)
        assert cancelled == 2


# -- errors ------------------------------------------------------------------------------------


async def test_unknown_model_is_404(mesh, client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        assert_error(await http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")


async def test_context_length_is_400_naming_the_limit(mesh, client):
    limit = 512 * 16
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": random_ids(limit - 10, 1),
                                                     "max_tokens": 100})
        err = assert_error(r, 400, "max_tokens", f"maximum context length is {limit} tokens")
        assert err["code"] == "context_length_exceeded"
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": random_ids(limit + 1, 2)})
        assert_error(r, 400, "prompt", str(limit))
        r = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": limit})
        assert_error(r, 400, "max_tokens", str(limit))
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt="hi", max_tokens=limit + 1)


async def test_malformed_json_is_400(mesh):
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for raw in (b'{"model": "tiny", "prompt": ', b"{'model': 'tiny'}", b"\xff\xfe", b""):
                r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                assert_error(r, 400)


BAD_VALUES = [
    ("/v1/chat/completions", {"temperature": 5}, "temperature"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"top_logprobs": 2}, None),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, None),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [5000000000]}, "prompt"),
    ("/v1/completions", {"prompt": [4096]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD_VALUES)
async def test_bad_values_are_400_naming_the_field(mesh, path, fields, param):
    body = {"model": "tiny", **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                                else {"prompt": "hi"}), **fields}
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        err = assert_error(await http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


async def test_unknown_fields_are_ignored(client):
    r = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="me",
        extra_body={"logit_bias_v2": {"1": 2}, "frobnicate": [1, 2], "metadata": None})
    assert r.choices[0].finish_reason in ("length", "stop")


WEIRD_BODIES = [
    b"null", b"[]", b"42", b'"prompt"', b"true", b"{}", b'{"model": null}', b'{"model": 1, "prompt": 2}',
    b'{"model": "tiny", "prompt": null}', b'{"model": "tiny", "prompt": {"a": 1}}',
    b'{"model": "tiny", "prompt": [[1, 2], 3]}', b'{"model": "tiny", "prompt": [1.5]}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny", "prompt": "x", "top_k": 99999999999999999999999999}',
    b'{"model": "tiny", "prompt": "x", "stop_token_ids": [99999999999999999999]}',
    b'{"model": "tiny", "prompt": "x", "priority": -99999999999999999999}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999999}',
    b'{"model": "tiny", "prompt": "x", "stream_options": "yes", "stream": true}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": null}], "max_tokens": 1}',
    b'{"model": "tiny", "messages": [{}]}', b'{"model": "tiny", "messages": {"role": "user"}}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": [null]}]}',
    b'{"model": "' + b"m" * 5000 + b'", "prompt": "x"}', b'{"model": "tiny\\u0000.*>", "prompt": "x"}',
    b'{"model": "tiny", "prompt": "x", "n": 16, "max_tokens": 1, "logprobs": 20, "echo": true}',
    b"[" * 5000 + b"]" * 5000, b'{"a": ' * 2000 + b"1" + b"}" * 2000,
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_weird_bodies_never_500(mesh, path):
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        for raw in WEIRD_BODIES:
            r = await http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (raw[:80], r.status_code, r.text)
            if r.status_code >= 400:
                assert_error(r, r.status_code)
            else:
                assert "error" not in r.json()
        # and the gateway is still fine
        assert (await http.get("/health")).status_code == 200
