"""Structured output end to end, through the official ``openai`` client: real nats-server, real
worker processes, the tiny random-weight model (left alone it writes no JSON and calls no tool,
so only the grammar can make its output valid).

Two meshes for the module, on the tiny model with Qwen2.5's chat template (it renders tools, and
its calls are Hermes ``<tool_call>`` JSON):

* ``agg`` (namespace ``st-agg``): two decode workers that prefill themselves, and a gateway. The
  whole 60-schema corpus runs here once, greedy and not streamed; its outputs are the reference
  every other path must reproduce token for token (greedy output is the same whichever path a
  request takes).
* ``split`` (namespace ``st-split``), one gateway for two models: ``tinyd``, a decode worker that
  sends every prompt to a prefill worker (the first token is sampled there, under the grammar), and
  ``tinyp``, a decode worker with a KV pool too small for its batch, so that it preempts.

The last test kills an ``agg`` decode worker mid-stream: the stream resumes on the other one,
which rebuilds the grammar's state from the tokens already streamed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from mesh.bus import Bus
from mesh.client import generate
from mesh.protocol import ConstraintSpec, GenerateRequest, SamplingOptions
from mesh.tokenizer import Tokenizer
from tests.helpers.cluster import Watcher, kill_serving_worker, router_choices, wait_http_ok

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
BY_NAME = {e["name"]: e["schema"] for e in CORPUS}
TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen2_5.jinja"
MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "Reply with JSON that fits the schema."}]
SAMPLE = ["flat_object", "booleans", "null_field"]  # extended below with the corpus' harder cases
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["tz"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, PING]
LONG = {"type": "object", "properties": {"digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "minItems": 200, "maxItems": 200}},
        "required": ["digits"], "additionalProperties": False}


def sample_names() -> list[str]:
    """A few schemas of each kind: anyOf, patterns, bounded numbers, nesting, enums, $ref."""
    names = list(SAMPLE)
    for feature in ('"anyOf"', '"pattern"', '"exclusiveMinimum"', '"$ref"', '"enum"', '"items"'):
        names.append(next(e["name"] for e in CORPUS if feature in json.dumps(e["schema"]) and e["name"] not in names))
    return names


def validate(text: str, schema: dict) -> object:
    """Parse and validate (numbers as decimals: ``163.33`` is a multiple of ``0.01``, not as a float)."""
    value = json.loads(text, parse_float=Decimal)
    jsonschema.validate(value, json.loads(json.dumps(schema), parse_float=Decimal))
    return value


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@dataclass(frozen=True)
class Mesh:
    url: str
    nats_url: str
    ns: str
    workers: dict

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def watcher(self) -> Watcher:
        return await Watcher.open(self.nats_url, ns=self.ns)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model) -> Path:
    """The tiny model with Qwen2.5's chat template (tools rendered, Hermes tool calls)."""
    d = tmp_path_factory.mktemp("structured") / "tiny"
    d.mkdir()
    for f in tiny_model.iterdir():
        (d / f.name).symlink_to(f)
    (d / "tokenizer_config.json").unlink()
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE.read_text()}))
    return d


async def _wait_ready(nats_url: str, ns: str, workers: list[str], prefill: str | None = None) -> None:
    w = await Watcher.open(nats_url, ns=ns)
    try:
        await w.wait_for(lambda: all(w.membership.get(x) for x in workers), 120, "workers")
        if prefill:
            await w.fresh_load(prefill, timeout=20)  # the decode worker has heard the prefill pool's load
    finally:
        await w.close()


@pytest.fixture(scope="module")
def agg(cluster, model) -> Mesh:
    ns = "st-agg"
    flags = ["--ns", ns, "--model", str(model), "--device-kv-blocks", "1024"]
    workers = {f"st-agg-{i}": cluster.worker("decode", *flags, "--worker-id", f"st-agg-{i}") for i in range(2)}
    url = cluster.gateway(model, None, "--ns", ns)
    wait_http_ok(f"{url}/health")
    asyncio.run(_wait_ready(cluster.nats_url, ns, list(workers)))
    return Mesh(url, cluster.nats_url, ns, workers)


@pytest.fixture(scope="module")
def split(cluster, model) -> Mesh:
    ns = "st-split"
    common = ["--ns", ns, "--model", str(model)]
    workers = {
        # room for every request of a batch: none falls back to a local prefill
        "st-pre": cluster.worker("prefill", *common, "--served-name", "tinyd", "--worker-id", "st-pre",
                                 "--prefill-capacity", "16"),
        # a slow prefill (2 busy cores) is waited for, not prefilled here: its tests count remote prefills
        "st-dis": cluster.worker("decode", *common, "--served-name", "tinyd", "--worker-id", "st-dis",
                                 "--disagg-threshold", "1", "--device-kv-blocks", "512", "--prefill-timeout", "120"),
        # 24 blocks of 16 tokens for 8 requests of ~40 prompt and up to 120 output tokens: it must preempt
        "st-small": cluster.worker("decode", *common, "--served-name", "tinyp", "--worker-id", "st-small",
                                   "--device-kv-blocks", "24"),
    }
    url = cluster.gateway(model, None, "--ns", ns, "--served-name", "tinyd", "--model", str(model),
                          "--served-name", "tinyp")
    wait_http_ok(f"{url}/health", timeout=180)  # it starts with three workers: slow on 2 busy cores
    asyncio.run(_wait_ready(cluster.nats_url, ns, list(workers), prefill="st-pre"))
    return Mesh(url, cluster.nats_url, ns, workers)


async def _chat_json(client, model: str, name: str, schema: dict, **kw) -> tuple[str, str]:
    kw = {"max_tokens": MAX_TOKENS, **kw}
    r = await client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format(name, schema),
                                             temperature=0, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


async def _stream_json(client, model: str, name: str, schema: dict, **kw) -> tuple[str, str, int]:
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format(name, schema),
                                                  temperature=0, max_tokens=MAX_TOKENS, stream=True, **kw)
    text, reason, chunks = "", None, 0
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        chunks += 1
        reason = choice.finish_reason or reason
    return text, reason, chunks


@pytest.fixture(scope="module")
def reference(agg) -> dict[str, str]:
    """The whole corpus on the aggregated mesh, greedy, not streamed, all at once."""

    async def run():
        async with agg.client() as client:
            return await asyncio.gather(*(_chat_json(client, "tiny", e["name"], e["schema"]) for e in CORPUS))

    results = asyncio.run(run())
    return {e["name"]: r for e, r in zip(CORPUS, results, strict=True)}


# -- aggregated ----------------------------------------------------------------------------------


def test_every_schema_of_the_corpus_validates(reference):
    assert len(reference) >= 50
    for name, (text, reason) in reference.items():
        assert reason == "stop", (name, reason, text)
        validate(text, BY_NAME[name])


async def test_without_a_grammar_the_model_writes_no_json(agg):
    async with agg.client() as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40)
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


async def test_streamed_outputs_are_the_whole_ones(agg, reference):
    async with agg.client() as client:
        got = await asyncio.gather(*(_stream_json(client, "tiny", n, BY_NAME[n]) for n in sample_names()))
    for name, (text, reason, chunks) in zip(sample_names(), got, strict=True):
        assert (text, reason) == reference[name], name
        assert chunks > 2  # role, content..., finish: it was streamed


async def test_completions_take_response_format_and_max_tokens_cuts_with_length(agg, reference):
    name = sample_names()[3]
    async with agg.client() as client:
        whole = await client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"response_format": response_format(name, BY_NAME[name])})
        cut = await client.completions.create(model="tiny", prompt="JSON:", max_tokens=3, temperature=0,
                                              extra_body={"response_format": {"type": "json_object"}})
    assert whole.choices[0].finish_reason == "stop"
    validate(whole.choices[0].text, BY_NAME[name])
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text.startswith("{")  # as OpenAI does


async def test_seeded_constrained_sampling_is_reproducible(agg):
    schema = BY_NAME[sample_names()[4]]

    async def sample(seed: int, n: int = 1) -> list[str]:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, n=n,
                                                 response_format=response_format("s", schema), max_tokens=MAX_TOKENS)
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.message.content for c in r.choices]

    async with agg.client() as client:
        first, again, other, pair = await asyncio.gather(sample(5), sample(5), sample(6), sample(5, n=2))
    for text in first + other + pair:
        validate(text, schema)
    assert first == again  # the same seed through the gateway, routed anywhere: the same output
    assert other != first
    assert pair[0] == first[0] and pair[1] != pair[0]  # choice k samples with seed + k


async def test_parse_with_a_pydantic_model(agg):
    class City(BaseModel):
        name: str = Field(max_length=16)
        population: int = Field(ge=0, le=10_000_000)
        capital: bool
        districts: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)

    async with agg.client() as client:
        r = await client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=City, temperature=0,
                                                max_tokens=MAX_TOKENS)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    assert len(city.districts) <= 3 and 0 <= city.population <= 10_000_000


def _check_calls(calls, names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "maxProperties": 0}
               for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
async def test_required_tools_return_calls_whose_arguments_validate(agg, parallel):
    async with agg.client() as client:
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                                 tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                                                 temperature=0, max_tokens=MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time", "ping"})
    if not parallel:
        assert len(choice.message.tool_calls) == 1


async def test_a_named_function_is_called_and_streams_as_openais_deltas(agg):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Time in Tokyo?"}], tools=TOOLS, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=MAX_TOKENS)
    async with agg.client() as client:
        whole = await client.chat.completions.create(**kw)
        stream = await client.chat.completions.create(**kw, stream=True)
        deltas, reason = [], None
        async for chunk in stream:
            deltas += chunk.choices[0].delta.tool_calls or []
            reason = chunk.choices[0].finish_reason or reason
    calls = whole.choices[0].message.tool_calls
    _check_calls(calls, {"get_time"})
    assert whole.choices[0].finish_reason == reason == "tool_calls"
    # the first delta of the call names it (id, type, name), the rest carry argument fragments
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert all(d.id is None and d.index == 0 for d in deltas[1:])  # how many: how the tokens were batched
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments


async def test_tool_choice_auto_parses_what_the_model_wrote(agg):
    """Left to choose, the random model writes text: it comes back as content, no calls, not a 400."""
    async with agg.client() as client:
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                 temperature=0, max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"


# -- disaggregated and preempted ---------------------------------------------------------------------


async def test_disaggregated_outputs_match_the_aggregated_ones(split, reference):
    """The prefill worker samples the first token under the grammar; the decode worker's matcher
    takes it and goes on: streamed and not, the outputs are the aggregated mesh's."""
    names = sample_names()
    async with split.client() as client:
        whole = await asyncio.gather(*(_chat_json(client, "tinyd", n, BY_NAME[n]) for n in names))
        streamed = await asyncio.gather(*(_stream_json(client, "tinyd", n, BY_NAME[n]) for n in names))
    for name, w, s in zip(names, whole, streamed, strict=True):
        assert w == reference[name] == s[:2], name
    w = await split.watcher()
    try:
        report = await w.fresh_load("st-dis")
    finally:
        await w.close()
    assert report.counters.get("remote_prefill_done", 0) >= 2 * len(names)
    assert report.counters.get("local_prefill", 0) == 0


async def test_preemption_keeps_outputs_valid_and_unchanged(split, reference):
    names = sorted(reference, key=lambda n: len(reference[n][0]), reverse=True)[:8]  # the longest outputs
    async with split.client() as client:
        got = await asyncio.gather(*(_chat_json(client, "tinyp", n, BY_NAME[n]) for n in names))
    for name, result in zip(names, got, strict=True):
        assert result == reference[name], name
    w = await split.watcher()
    try:
        report = await w.fresh_load("st-small")
    finally:
        await w.close()
    assert report.counters["preemptions"] > 0


@pytest.mark.parametrize("spec, says", [
    (ConstraintSpec("yaml", "a: 1"), "unknown constraint kind"),
    (ConstraintSpec("json_schema", "{nope"), "not valid JSON"),
    (ConstraintSpec("lark", "start: <[999999]>"), "invalid lark"),
    (ConstraintSpec("json_object", start_after=1 << 20), "outside the vocabulary"),
    (ConstraintSpec("json_object"), "do not match the constraint"),  # resumed after tokens it rejects
], ids=["kind", "schema", "lark", "start_after", "replay"])
async def test_a_constraint_a_worker_cannot_enforce_is_a_400_chunk(split, model, spec, says):
    """What a custom gateway gets on the bus (ours checks schemas first): one error chunk, 400, from
    the decode worker of either mesh; the worker goes on serving."""
    prompt = Tokenizer(model).encode("hello there")
    bus = await Bus.connect(split.nats_url, "st-test", ns=split.ns)
    try:
        for worker, name in (("st-dis", "tinyd"), ("st-small", "tinyp")):
            req = GenerateRequest(f"bad-{worker}-{says[:6]}", name, prompt, SamplingOptions(max_tokens=4, constraint=spec))
            if says.startswith("do not match"):
                req.output_offset = 2  # "hello there" is not the start of a JSON object
            chunks = [c async for c in generate(bus, worker, req, first_timeout=30)]
            assert len(chunks) == 1 and chunks[0].finish_reason == "error", chunks
            assert chunks[0].error_status == 400 and says in chunks[0].error, chunks[0].error
            ok = GenerateRequest(f"ok-{worker}-{says[:6]}", name, prompt, SamplingOptions(
                max_tokens=4, constraint=ConstraintSpec("json_object")))
            chunks = [c async for c in generate(bus, worker, ok, first_timeout=30)]
            assert chunks[-1].finish_reason == "length" and not chunks[-1].error
    finally:
        await bus.close()


# -- a worker stopped ------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    return [int(c) for t in os.listdir(f"/proc/{pid}/task")
            for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]


def _shared_memory(pid: int) -> set[str]:
    """The POSIX shared memory segments (``psm_*``, multiprocessing's) that ``pid`` has mapped."""
    return set(re.findall(r"/dev/shm/(psm_\w+)", Path(f"/proc/{pid}/maps").read_text()))


async def _one_constrained_request(nats_url: str, ns: str, worker: str, model: Path) -> None:
    await _wait_ready(nats_url, ns, [worker])
    bus = await Bus.connect(nats_url, f"{worker}-test", ns=ns)
    try:
        req = GenerateRequest(f"{worker}-1", "tiny", Tokenizer(model).encode("hello"), SamplingOptions(
            max_tokens=8, constraint=ConstraintSpec("json_object")))
        chunks = [c async for c in generate(bus, worker, req, first_timeout=60)]
        assert chunks[-1].finish_reason == "length" and not chunks[-1].error
    finally:
        await bus.close()


def test_a_stopped_worker_ends_its_grammar_process_and_frees_its_shared_memory(cluster, model):
    """Ctrl-C on a worker that served a constrained request: it closes its engine, so its grammar
    process exits and the masks' shared buffer is unlinked by the worker itself (not left to the
    resource tracker, which warns about a leak)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "cli", "worker", "decode", "--nats", cluster.nats_url,
                             "--ns", "st-stop", "--model", str(model), "--worker-id", "st-stop",
                             "--device-kv-blocks", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        asyncio.run(_one_constrained_request(cluster.nats_url, "st-stop", "st-stop", model))
        grammar = [c for c in _children(proc.pid) if "replica" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(grammar) == 1
        # the masks' buffer, by name (other tests' workers may make and free their own meanwhile)
        masks = _shared_memory(proc.pid) | _shared_memory(grammar[0])
        assert masks
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "leaked shared_memory" not in err, err
    assert not os.path.exists(f"/proc/{grammar[0]}")
    assert not [f for f in masks if os.path.exists(f"/dev/shm/{f}")]


# -- a worker killed mid-stream (last: it leaves agg with one worker) ---------------------------------


async def test_a_worker_killed_mid_stream_resumes_and_the_json_still_validates(agg):
    """~400 tokens of JSON; the serving worker is killed after 5 chunks (the other one writes the
    ~395 after them). The router's decision names it (a load report may come a second later, when a
    fast CPU has ended the stream)."""
    kw = dict(model="tiny", messages=MESSAGES, response_format=response_format("long", LONG), temperature=0,
              max_tokens=500)
    async with agg.client() as client:
        whole = await client.chat.completions.create(**kw)
        reference = whole.choices[0].message.content
        assert whole.choices[0].finish_reason == "stop"
        validate(reference, LONG)
        w = await agg.watcher()
        try:
            chosen = await router_choices(w)
            stream = await client.chat.completions.create(**kw, stream=True)
            text, reason, killed, chunks = "", None, None, 0
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
                chunks += 1
                if killed is None and chunks == 5:
                    killed = await kill_serving_worker(w, agg.workers, chosen=chosen)
        finally:
            await w.close()
    assert killed is not None and reason == "stop"
    validate(text, LONG)
    assert text == reference  # no token lost or repeated: the new worker's grammar took up where it was
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{agg.url}/metrics")).text
    assert "pdmesh_gateway_migrations_total 1" in metrics
