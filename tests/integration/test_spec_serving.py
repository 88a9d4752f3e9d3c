"""Speculative decoding on every serving path (issue 34): greedy outputs through the gateway are
token-identical to decoding without speculation, for each drafter (``ngram``; ``draft:DIR``, the
tiny model drafting for itself; ``eagle3:DIR`` with a random head) in real decode worker processes. The reference: transformers (and peft for adapters) for short outputs; for long ones
our engine without speculation in this process (transformers' eager generate takes a minute for
600 tokens here), which the engine tests hold to transformers' logits.

One mesh per drafter (``ngram``, then ``draft``): two decode workers that draft (a small KV pool,
two LoRA adapters, prompts of 48 tokens and more prefilled by the prefill worker), one prefill
worker and one gateway; every test runs on each. Prompts repeat themselves, so prompt lookup finds
drafts the target accepts (a model drafting for itself is always right); every test checks from
the workers' own counters that drafts were verified. The last test kills a decode worker. The
EAGLE-3 head (random weights: its drafts are verified, almost never accepted, so its rows soon
draft only probes) has a mesh of its own for the aggregated and disaggregated paths.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers.cluster import Watcher, router_choices, stream_killing_its_worker, wait_http_ok
from tests.helpers.eagle3 import make_eagle3_checkpoint
from tests.helpers.lora import ADAPTERS, make_adapter
from tests.helpers.procs import stop_processes
from tests.helpers.references import hf_greedy, hf_model, prompts_of

DRAFTERS = ("ngram", "draft")  # the methods the module's mesh runs each test with
THRESHOLD = 48  # prompts this long are prefilled by the prefill worker
BLOCKS = 48  # each decode worker's KV pool (blocks of 16): 16 requests of 144 tokens preempt
MAX_TOKENS = 24
LORAS = ("all", "mlp")
NS_EAGLE = "spec-e3"
EAGLE = ("spec-e3-dec", "spec-e3-pre")  # its decode worker, its prefill worker


def repeating(n: int, seed: int, times: int = 3) -> list[int]:
    """A prompt of ``n`` random ids said ``times`` times: something for prompt lookup to find."""
    return prompts_of([n], 4000, seed, low=3)[0] * times


SHORT = [repeating(n, 10 + n) for n in (6, 8, 10)]  # 18-30 tokens: prefilled where they decode
LONG = [repeating(n, 20 + n) for n in (17, 22)]  # 51, 66 tokens: disaggregated


@pytest.fixture(scope="module")
def hf(tiny_model):
    """transformers' greedy outputs of ``SHORT`` and ``LONG`` (``MAX_TOKENS`` each)."""
    model = hf_model(tiny_model)
    return [hf_greedy(model, p, MAX_TOKENS) for p in SHORT + LONG]


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Greedy outputs of our engine without speculation: ``plain(prompts, n)``."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    engine = Engine(EngineConfig(tiny_model, device="cpu", num_kv_blocks=512))
    yield lambda prompts, n: [s.output_token_ids for s in engine.generate(
        prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]
    engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-lora")
    return {name: make_adapter(tiny_model, root / name, seed, **ADAPTERS[name])
            for seed, name in enumerate(LORAS, start=1)}


@dataclass
class Mesh:
    url: str
    workers: dict  # decode worker id -> its process
    method: str  # the drafter's name, as its counters carry it
    ns: str
    decode: tuple[str, ...]
    prefill: str

    def counter(self, kind: str) -> str:
        return f"spec_{kind}:{self.method}"

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.decode, self.prefill)


def wait_ready(cluster, ns: str, names: tuple[str, ...], url: str) -> None:
    """Until every worker of ``names`` (the prefill worker last) is registered, the decode workers
    have heard the prefill pool, and the gateway at ``url`` answers /health."""
    async def ready():
        w = await Watcher.open(cluster.nats_url, ns=ns)
        try:
            await w.wait_for(lambda: all(w.membership.get(x) for x in names), 180, "workers")
            await w.fresh_load(names[-1])  # the decode workers have heard the prefill pool
        finally:
            await w.close()

    asyncio.run(ready())
    wait_http_ok(url + "/health", 60)


@pytest.fixture(scope="module", params=DRAFTERS)
def mesh(request, cluster, tiny_model, adapters):
    method = request.param
    ns = f"spec-{method}"
    decode, prefill = (f"{ns}-dec-0", f"{ns}-dec-1"), f"{ns}-pre"
    spec = "ngram" if method == "ngram" else f"draft:{tiny_model}"
    started = len(cluster.procs)
    common = ["--ns", ns, "--model", str(tiny_model), "--transports", "shm", "--block-size", "16"]
    loras = [arg for name, d in adapters.items() for arg in ("--lora", f"{name}={d}")]
    workers = {wid: cluster.worker("decode", *common, *loras, "--device-kv-blocks", str(BLOCKS),
                                   "--speculative", spec, "--num-speculative-tokens", "3",
                                   "--disagg-threshold", str(THRESHOLD), "--worker-id", wid)
               for wid in decode}
    cluster.worker("prefill", *common, "--device-kv-blocks", "256", "--worker-id", prefill)
    url = cluster.gateway(tiny_model, None, "--ns", ns)

    wait_ready(cluster, ns, (*decode, prefill), url)
    yield Mesh(url, workers, method, ns, decode, prefill)
    stop_processes(cluster.procs[started:])  # the next drafter's mesh starts on a quiet box
    del cluster.procs[started:]


@pytest.fixture(scope="module")
def eagle_mesh(cluster, tiny_model, tmp_path_factory):
    """A mesh of its own for ``eagle3:DIR`` (a random head: its drafts are verified, almost never
    accepted): one decode worker, one prefill worker, a gateway."""
    head = make_eagle3_checkpoint(tiny_model, tmp_path_factory.mktemp("spec-eagle3") / "head", aux_layers=[1, 0, 1])
    common = ["--ns", NS_EAGLE, "--model", str(tiny_model), "--transports", "shm", "--block-size", "16"]
    cluster.worker("decode", *common, "--device-kv-blocks", "128", "--speculative", f"eagle3:{head}",
                   "--num-speculative-tokens", "3", "--disagg-threshold", str(THRESHOLD), "--worker-id", EAGLE[0])
    cluster.worker("prefill", *common, "--device-kv-blocks", "256", "--worker-id", EAGLE[1])
    url = cluster.gateway(tiny_model, None, "--ns", NS_EAGLE)

    wait_ready(cluster, NS_EAGLE, EAGLE, url)
    return url


@asynccontextmanager
async def counters(cluster, ns: str, names: tuple[str, ...]):
    """The workers' counters added up, after the block minus before."""
    w = await Watcher.open(cluster.nats_url, ns=ns)
    delta: dict[str, int] = {}
    try:
        before = [r.counters for r in await asyncio.gather(*(w.fresh_load(x) for x in names))]
        yield delta
        after = [r.counters for r in await asyncio.gather(*(w.fresh_load(x) for x in names))]
        for b, a in zip(before, after, strict=True):
            for k, v in a.items():
                delta[k] = delta.get(k, 0) + v - b.get(k, 0)
    finally:
        await w.close()


async def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, model: str = "tiny", **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["text"]


async def test_aggregated_and_disaggregated_outputs_are_transformers(cluster, mesh, hf):
    url = mesh.url
    prompts = SHORT + LONG
    async with counters(cluster, mesh.ns, mesh.names) as delta:
        got = await asyncio.gather(*(complete(url, p) for p in prompts))
    for p, (tokens, _), want in zip(prompts, got, hf, strict=True):
        assert tokens == want, f"prompt of {len(p)} tokens"
    assert delta.get(mesh.counter("accepted"), 0) > 0, delta  # drafts were verified and accepted
    assert delta.get("remote_prefill_done", 0) >= len(LONG), delta  # the long ones were disaggregated


async def test_eagle3_aggregated_and_disaggregated_outputs_are_transformers(cluster, eagle_mesh, hf):
    """``eagle3:DIR`` drafts from the target's hidden states; the disaggregated prompts' states
    (their KV came from the prefill worker) are rebuilt by the decode worker."""
    prompts = SHORT + LONG
    async with counters(cluster, NS_EAGLE, EAGLE) as delta:
        got = await asyncio.gather(*(complete(eagle_mesh, p) for p in prompts))
    for p, (tokens, _), want in zip(prompts, got, hf, strict=True):
        assert tokens == want, f"prompt of {len(p)} tokens"
    assert delta.get("spec_drafted:eagle3", 0) > 0, delta
    assert delta.get("remote_prefill_done", 0) >= len(LONG), delta
    assert delta.get("spec_rebuilt:eagle3", 0) >= sum(len(p) for p in LONG), delta


async def test_a_request_that_opts_out_drafts_nothing(cluster, mesh, plain):
    url = mesh.url
    prompt = repeating(7, 77, times=4)
    async with counters(cluster, mesh.ns, mesh.names) as opted_out:
        tokens, _ = await complete(url, prompt, speculate=False)
    assert tokens == plain([prompt], MAX_TOKENS)[0]
    assert opted_out.get(mesh.counter("drafted"), 0) == 0, opted_out
    async with counters(cluster, mesh.ns, mesh.names) as speculated:
        again, _ = await complete(url, prompt)
    assert again == tokens and speculated.get(mesh.counter("drafted"), 0) > 0, speculated


async def test_a_json_schema_row_drafts_and_is_identical(cluster, mesh, hf):
    """A constrained row drafts itself (its drafts checked by its grammar, each drafted position
    under the mask of the state after the drafts before it), alone and beside rows whose drafts are
    verified in the same steps; its output is the one it gets without speculation, and valid JSON."""
    url = mesh.url
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"},
                                               "c": {"type": "array", "items": {"enum": ["x", "yz"]},
                                                     "minItems": 4, "maxItems": 4}},
              "required": ["a", "b", "c"], "additionalProperties": False}  # bounded: it ends within max_tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    prompt = repeating(9, 91)
    alone, text = await complete(url, prompt, 60, response_format=fmt, speculate=False, ignore_eos=False)
    assert set(json.loads(text)) == {"a", "b", "c"}
    async with counters(cluster, mesh.ns, mesh.names) as own:
        drafted, _ = await complete(url, prompt, 60, response_format=fmt, ignore_eos=False)
    assert drafted == alone
    if mesh.method == "ngram":  # prompt lookup finds the JSON's own repeats: the row's own drafts verified
        assert own.get(mesh.counter("drafted"), 0) > 0, own
    # (a draft model proposes its unconstrained continuation: the grammar cuts it at its first token,
    # so the row verifies nothing of it; identity is what this checks there)
    async with counters(cluster, mesh.ns, mesh.names) as delta:
        got = await asyncio.gather(complete(url, prompt, 60, response_format=fmt, ignore_eos=False),
                                   *(complete(url, p) for p in SHORT))
    assert got[0][0] == alone
    assert [tokens for tokens, _ in got[1:]] == hf[:len(SHORT)]
    assert delta.get(mesh.counter("drafted"), 0) > 0, delta


async def test_a_batch_mixing_adapters_is_peft(cluster, mesh, tiny_model, adapters):
    from peft import PeftModel

    url = mesh.url
    jobs = [(name, SHORT[2]) for name in (None, *LORAS)]
    expected = []
    for name, p in jobs:
        model = hf_model(tiny_model)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        expected.append(hf_greedy(model, p, MAX_TOKENS))
    async with counters(cluster, mesh.ns, mesh.names) as delta:
        got = await asyncio.gather(*(complete(url, p, model=name or "tiny") for name, p in jobs))
    for (name, p), (tokens, _), want in zip(jobs, got, expected, strict=True):
        assert tokens == want, f"{name or 'base'}, prompt of {len(p)} tokens"
    assert len({str(w) for w in expected}) > 1  # the adapters change the output
    assert delta.get(mesh.counter("drafted"), 0) > 0, delta


async def test_under_preemption(cluster, mesh, plain):
    """16 requests of 144 tokens (two prompts, 8 times each) on two pools of 48 blocks of 16: one
    worker has at least 8, which need 8 x 8 blocks beside their shared first one, so running rows
    are preempted (their drafts' blocks included) and recomputed."""
    url = mesh.url
    pair = [repeating(8, 300), repeating(8, 301)]
    n = 120
    async with counters(cluster, mesh.ns, mesh.names) as delta:
        got = await asyncio.gather(*(complete(url, pair[i % 2], n) for i in range(16)))
    want = plain(pair, n)
    for i, (tokens, _) in enumerate(got):
        assert tokens == want[i % 2], i
    assert delta.get("preemptions", 0) > 0, delta
    assert delta.get(mesh.counter("drafted"), 0) > 0, delta


async def test_a_decode_worker_killed_mid_stream(cluster, mesh, plain):
    """kill -9 of the worker that serves a stream: the gateway migrates it to the other one, which
    drafts on; the client's tokens are those without speculation (none lost, none repeated)."""
    url, workers = mesh.url, mesh.workers
    prompt = repeating(8, 808)
    n = 300
    w = await Watcher.open(cluster.nats_url, ns=mesh.ns)
    chosen = await router_choices(w)  # a stream this short can end before a load report says where it runs
    try:
        got, killed = await stream_killing_its_worker(url, "tiny", prompt, n, w, workers, after=8, chosen=chosen)
        assert got == plain([prompt], n)[0]
        survivor = next(x for x in mesh.decode if x != killed)
        report = await w.fresh_load(survivor)
        assert report.counters.get(mesh.counter("drafted"), 0) > 0
        async with httpx.AsyncClient(timeout=10) as client:
            metrics = (await client.get(f"{url}/metrics")).text
        assert "pdmesh_gateway_migrations_total 1" in metrics
    finally:
        await w.close()
