"""Speculative decoding on every serving path (issue 34): greedy outputs through the gateway are
token-identical to decoding without speculation, for each drafter (``ngram``; ``draft:DIR``, the
tiny model drafting for itself; ``eagle3:DIR`` with a random head) in real decode worker processes.
The reference: transformers (and peft for adapters) for short outputs; for long ones our engine
without speculation in this process (transformers' eager generate takes a minute for 600 tokens
here), which the engine tests hold to transformers' logits.

One mesh per drafter (``ngram``, ``draft``, then ``eagle3``): two decode workers that draft (a
small KV pool, two LoRA adapters, prompts of 48 tokens and more prefilled by the prefill worker),
one prefill worker and one gateway; every test runs on each, and the next mesh comes up while the
one before it runs its tests. Prompts repeat themselves, so prompt lookup finds drafts the target
accepts (a model drafting for itself is always right); every test checks from the workers' own
counters that drafts were verified. The last test kills a decode worker. The EAGLE-3 head has random weights: its drafts are verified and almost never accepted,
so its workers run with a fixed K (``--no-speculative-adaptive``: adaptive K would soon stop its
rows drafting), and every step of every row verifies drafts and rolls them back; its counters
also show the target states it rebuilt for tokens computed elsewhere (``spec_rebuilt:eagle3``).
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

DRAFTERS = ("ngram", "draft", "eagle3")  # the methods the module's mesh runs each test with
THRESHOLD = 48  # prompts this long are prefilled by the prefill worker
BLOCKS = 32  # each decode worker's KV pool (blocks of 16): 8 requests of 144 tokens preempt
MAX_TOKENS = 24
LORAS = ("all", "mlp")
K = 3  # --num-speculative-tokens


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
    done: dict[tuple, list[int]] = {}  # each drafter's tests ask for the same ones

    def outputs(prompts, n):
        todo = [p for p in prompts if (tuple(p), n) not in done]
        if todo:
            seqs = engine.generate(todo, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            done.update({(tuple(p), n): s.output_token_ids for p, s in zip(todo, seqs, strict=True)})
        return [done[tuple(p), n] for p in prompts]

    yield outputs
    engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-lora")
    return {name: make_adapter(tiny_model, root / name, seed, **ADAPTERS[name])
            for seed, name in enumerate(LORAS, start=1)}


@pytest.fixture(scope="module")
def eagle3_head(tiny_model, tmp_path_factory):
    """A random EAGLE-3 head for the tiny model, reading the inputs of its layers 1, 0 and 1."""
    return make_eagle3_checkpoint(tiny_model, tmp_path_factory.mktemp("spec-eagle3") / "head", aux_layers=[1, 0, 1])


@pytest.fixture(scope="module")
def peft_outputs(tiny_model, adapters):
    """peft's greedy outputs (``MAX_TOKENS``) of ``SHORT[2]`` on the base model and each adapter."""
    from peft import PeftModel

    out = []
    for name in (None, *LORAS):
        model = hf_model(tiny_model)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        out.append(hf_greedy(model, SHORT[2], MAX_TOKENS))
    return out


@dataclass
class Mesh:
    url: str
    workers: dict  # decode worker id -> its process
    method: str  # the drafter's name, as its counters carry it
    ns: str
    decode: tuple[str, ...]
    prefill: str
    procs: list  # all its processes, the gateway's too

    def counter(self, kind: str) -> str:
        return f"spec_{kind}:{self.method}"

    @property
    def fixed_k(self) -> bool:
        """Its workers draft K at every step (the random EAGLE-3 head; adaptive K otherwise)."""
        return self.method == "eagle3"

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


def start_mesh(cluster, method: str, tiny_model, adapters, spec: list[str]) -> Mesh:
    """The processes of ``method``'s mesh, started (``wait_ready`` waits for them); ``spec``: the
    decode workers' drafter flags."""
    ns = f"spec-{method}"
    decode, prefill = (f"{ns}-dec-0", f"{ns}-dec-1"), f"{ns}-pre"
    started = len(cluster.procs)
    common = ["--ns", ns, "--model", str(tiny_model), "--transports", "shm", "--block-size", "16"]
    loras = [arg for name, d in adapters.items() for arg in ("--lora", f"{name}={d}")]
    workers = {wid: cluster.worker("decode", *common, *loras, "--device-kv-blocks", str(BLOCKS),
                                   *spec, "--num-speculative-tokens", str(K),
                                   "--disagg-threshold", str(THRESHOLD), "--worker-id", wid)
               for wid in decode}
    cluster.worker("prefill", *common, "--device-kv-blocks", "256", "--worker-id", prefill)
    url = cluster.gateway(tiny_model, None, "--ns", ns)
    return Mesh(url, workers, method, ns, decode, prefill, cluster.procs[started:])


def drafter_flags(request, method: str) -> list[str]:
    tiny_model = request.getfixturevalue("tiny_model")
    if method == "eagle3":  # a random head: a fixed K, or its rows would soon stop drafting
        return ["--speculative", f"eagle3:{request.getfixturevalue('eagle3_head')}", "--no-speculative-adaptive"]
    return ["--speculative", "ngram" if method == "ngram" else f"draft:{tiny_model}"]


@pytest.fixture(scope="module")
def meshes() -> dict[str, Mesh]:
    """The drafters' meshes started so far."""
    return {}


@pytest.fixture(scope="module", params=DRAFTERS)
def mesh(request, cluster, tiny_model, adapters, meshes):
    """The drafter's mesh, ready; the next drafter's starts now, to come up while this one's tests
    run (at most two meshes at a time: this one's processes stop after its tests)."""
    used = {cs.params["mesh"] for item in request.session.items  # the drafters of the tests selected
            if item.module is request.module and (cs := getattr(item, "callspec", None)) and "mesh" in cs.params}
    order = [m for m in DRAFTERS if m in used]
    for method in order[order.index(request.param):][:2]:
        if method not in meshes:
            meshes[method] = start_mesh(cluster, method, tiny_model, adapters, drafter_flags(request, method))
    m = meshes[request.param]
    wait_ready(cluster, m.ns, m.names, m.url)
    yield m
    stop_processes(m.procs)
    cluster.procs[:] = [p for p in cluster.procs if p not in m.procs]


class Counters:
    """The workers' counters added up, from their load reports: ``async with c.delta() as d`` fills
    ``d`` with after the block minus before. The reports that end one block begin the next (so no
    request may run between them)."""

    def __init__(self, w: Watcher, names: tuple[str, ...]):
        self.w, self.names = w, names
        self.last: list[dict[str, int]] | None = None

    async def _fresh(self) -> list[dict[str, int]]:
        return [r.counters for r in await asyncio.gather(*(self.w.fresh_load(x) for x in self.names))]

    @asynccontextmanager
    async def delta(self):
        before, self.last = self.last or await self._fresh(), None
        delta: dict[str, int] = {}
        yield delta
        self.last = after = await self._fresh()
        for b, a in zip(before, after, strict=True):
            for k, v in a.items():
                delta[k] = delta.get(k, 0) + v - b.get(k, 0)


@asynccontextmanager
async def watching(cluster, mesh: Mesh):
    w = await Watcher.open(cluster.nats_url, ns=mesh.ns)
    try:
        yield Counters(w, mesh.names)
    finally:
        await w.close()


@asynccontextmanager
async def counters(cluster, mesh: Mesh):
    """The mesh's counters added up, after the block minus before."""
    async with watching(cluster, mesh) as c, c.delta() as delta:
        yield delta


def assert_verified(mesh: Mesh, delta: dict, rows: int, max_tokens: int = MAX_TOKENS) -> None:
    """Drafts were verified; with a fixed K, at every decoding step of each of ``rows`` rows but its
    last (where ``max_tokens`` leaves no room): each row emitted ``max_tokens - 2`` tokens or more
    from verification steps, whatever was accepted."""
    assert delta.get(mesh.counter("drafted"), 0) > 0, delta
    if mesh.fixed_k:
        assert delta.get(mesh.counter("emitted"), 0) >= rows * (max_tokens - 2), delta


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
    async with counters(cluster, mesh) as delta:
        got = await asyncio.gather(*(complete(url, p) for p in prompts))
    for p, (tokens, _), want in zip(prompts, got, hf, strict=True):
        assert tokens == want, f"prompt of {len(p)} tokens"
    assert_verified(mesh, delta, len(prompts))
    assert delta.get("remote_prefill_done", 0) >= len(LONG), delta  # the long ones were disaggregated
    if mesh.method == "eagle3":  # the disaggregated prompts' states were rebuilt by the decode workers
        assert delta.get(mesh.counter("rebuilt"), 0) >= sum(len(p) for p in LONG), delta
    else:  # drafts the target accepts (a random head's almost never are)
        assert delta.get(mesh.counter("accepted"), 0) > 0, delta


async def test_a_request_that_opts_out_drafts_nothing(cluster, mesh, plain):
    url = mesh.url
    prompt = repeating(7, 77, times=4)
    async with watching(cluster, mesh) as c:
        async with c.delta() as opted_out:
            tokens, _ = await complete(url, prompt, speculate=False)
        async with c.delta() as speculated:
            again, _ = await complete(url, prompt)
    assert tokens == plain([prompt], MAX_TOKENS)[0]
    assert opted_out.get(mesh.counter("drafted"), 0) == 0, opted_out
    assert again == tokens
    assert_verified(mesh, speculated, 1)


@pytest.fixture(scope="module")
def unspeculated() -> dict:
    """Outputs through the first mesh's gateway with speculation off, by request: the reference of
    those the later meshes' drafting rows must match."""
    return {}


async def test_a_json_schema_row_drafts_and_is_identical(cluster, mesh, hf, unspeculated):
    """A constrained row drafts itself (its drafts checked by its grammar, each drafted position
    under the mask of the state after the drafts before it), alone (``ngram``) and beside rows whose
    drafts are verified in the same steps; its output is the one it gets without speculation, and
    valid JSON."""
    url = mesh.url
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"},
                                               "c": {"type": "array", "items": {"enum": ["x", "yz"]},
                                                     "minItems": 4, "maxItems": 4}},
              "required": ["a", "b", "c"], "additionalProperties": False}  # bounded: it ends within max_tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    prompt = repeating(9, 91)
    if "json" not in unspeculated:
        unspeculated["json"] = await complete(url, prompt, 60, response_format=fmt, speculate=False, ignore_eos=False)
    alone, text = unspeculated["json"]
    assert set(json.loads(text)) == {"a", "b", "c"}
    async with watching(cluster, mesh) as c:
        if mesh.method == "ngram":  # prompt lookup finds the JSON's own repeats: the row's own drafts verified
            async with c.delta() as own:
                drafted, _ = await complete(url, prompt, 60, response_format=fmt, ignore_eos=False)
            assert drafted == alone
            assert own.get(mesh.counter("drafted"), 0) > 0, own
        # (a draft model, an EAGLE-3 head, propose their unconstrained continuation: the grammar cuts
        # it at its first token, so the row verifies almost nothing of it; beside drafting rows
        # below, identity is what this checks there)
        async with c.delta() as delta:
            got = await asyncio.gather(complete(url, prompt, 60, response_format=fmt, ignore_eos=False),
                                       *(complete(url, p) for p in SHORT))
    assert got[0][0] == alone
    assert [tokens for tokens, _ in got[1:]] == hf[:len(SHORT)]
    assert_verified(mesh, delta, len(SHORT))


async def test_a_batch_mixing_adapters_is_peft(cluster, mesh, peft_outputs):
    url = mesh.url
    jobs = [(name, SHORT[2]) for name in (None, *LORAS)]
    expected = peft_outputs
    async with counters(cluster, mesh) as delta:
        got = await asyncio.gather(*(complete(url, p, model=name or "tiny") for name, p in jobs))
    for (name, p), (tokens, _), want in zip(jobs, got, expected, strict=True):
        assert tokens == want, f"{name or 'base'}, prompt of {len(p)} tokens"
    assert len({str(w) for w in expected}) > 1  # the adapters change the output
    assert_verified(mesh, delta, len(jobs))  # EAGLE-3: the adapters' rows too, their states computed here


async def test_under_preemption(cluster, mesh, plain):
    """8 requests of 144 tokens (two prompts, 4 times each) on two pools of 32 blocks of 16: one
    worker has at least 4, which need 4 x 8 blocks beside their first ones, so running rows are
    preempted (their drafts' blocks included) and recomputed."""
    url = mesh.url
    pair = [repeating(8, 300), repeating(8, 301)]
    n = 120
    async with counters(cluster, mesh) as delta:
        got = await asyncio.gather(*(complete(url, pair[i % 2], n) for i in range(8)))
    want = plain(pair, n)
    for i, (tokens, _) in enumerate(got):
        assert tokens == want[i % 2], i
    assert delta.get("preemptions", 0) > 0, delta
    assert delta.get(mesh.counter("drafted"), 0) > 0, delta


async def test_a_decode_worker_killed_mid_stream(cluster, mesh, plain):
    """kill -9 of the worker that serves a stream (disaggregated: its prompt is long): the gateway
    migrates it to the other one, which drafts on (EAGLE-3: from the states it rebuilt, the
    resumed prompt's KV having come from the prefill worker); the client's tokens are those
    without speculation (none lost, none repeated)."""
    url, workers = mesh.url, mesh.workers
    prompt = repeating(17, 808)  # 51 tokens
    n = 160
    w = await Watcher.open(cluster.nats_url, ns=mesh.ns)
    chosen = await router_choices(w)  # a stream this short can end before a load report says where it runs
    try:
        reports = await asyncio.gather(*(w.fresh_load(x) for x in mesh.decode))
        before = {r.worker_id: r.counters for r in reports}
        got, killed = await stream_killing_its_worker(url, "tiny", prompt, n, w, workers, after=8, chosen=chosen)
        assert got == plain([prompt], n)[0]
        survivor = next(x for x in mesh.decode if x != killed)
        after = (await w.fresh_load(survivor)).counters
        delta = {k: v - before[survivor].get(k, 0) for k, v in after.items()}
        assert delta.get(mesh.counter("drafted"), 0) > 0, delta
        assert delta.get("remote_prefill_done", 0) >= 1, delta
        if mesh.method == "eagle3":
            assert delta.get(mesh.counter("rebuilt"), 0) >= len(prompt) + 8, delta
        async with httpx.AsyncClient(timeout=10) as client:
            metrics = (await client.get(f"{url}/metrics")).text
        assert "pdmesh_gateway_migrations_total 1" in metrics
    finally:
        await w.close()
