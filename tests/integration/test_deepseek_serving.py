"""The tiny DeepSeek-V3 (MLA: one latent vector per token and layer in every KV block) on the
whole mesh, through ``mesh up`` and the official ``openai`` client, against transformers' greedy
generate (computed once for the module), in both its configs: ``deepseek`` (q_lora_rank set) and
``deepseek-yarn`` (q_lora_rank null, YaRN rope scaling).

One ``mesh up`` for the module (``--nats``: the test's server, so a watcher sees its workers)
serving both models: per model a prefill worker and two decode workers, ``shm`` between them,
n-gram speculation, a small device pool over a host tier, and peer fetch. Its tests only read
from it, except the last, which kills a decode worker of each model:

- aggregated (short prompts) and disaggregated over shm (long ones), with speculation off per
  request; the cards state the latent block's bytes (what the router costs a move by);
- n-gram speculation, drafts verified over the latent cache; a prompt sent again is a
  prefix-cache hit;
- (``deepseek`` only) a JSON schema, whose first token the prefill worker samples under the grammar: valid, and the
  same with and without speculation;
- (``deepseek`` only) peer fetch: a prefix in one decode worker's host tier, fetched by the other (the router in the
  test process plans it, as the gateway's does): the cold run's tokens, counted as peer hits;
- kill -9 of the decode worker serving a stream: the gateway migrates it, the tokens stay
  transformers'.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
import torch

from kvstore.hashing import HashKey, generate_hash_key
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.helpers.cluster import Watcher, router_choices, start_up
from tests.helpers.peer_fetch import BS, PREFIX_BLOCKS, ask, plan_of, prefix_in_host_tier
from tests.helpers.procs import stop_processes
from tests.helpers.references import hf_greedy, hf_model, prompts_of

NS = "ds"
MODEL = "deepseek"  # the served names: the checkpoints' directories
MODELS = [MODEL, "deepseek-yarn"]
THRESHOLD = 48  # prompts this long are prefilled by the prefill worker
MAX_TOKENS = 16
SHORT = prompts_of([5, 21, 40], 4000, seed=11, low=3)  # prefilled where they decode
LONG = prompts_of([60, 130], 4000, seed=12, low=3)  # over shm
REPEATING = [p * 3 for p in prompts_of([7, 19], 4000, seed=13, low=3)]  # something for prompt lookup (21, 57)
MIGRATED = prompts_of([70], 4000, seed=14, low=3)[0]
MIGRATED_TOKENS = 80
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"},
                                           "c": {"type": "array", "items": {"enum": ["x", "yz"]},
                                                 "minItems": 3, "maxItems": 3}},
          "required": ["a", "b", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf(deepseek_models):
    """transformers' greedy tokens: ``hf[model, tuple(prompt), n]`` (on one thread: its tiny matmuls
    run 4x faster so on this shared machine than on two)."""
    jobs = [(p, MAX_TOKENS) for p in SHORT + LONG + REPEATING] + [(MIGRATED, MIGRATED_TOKENS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name in MODELS:
            model = hf_model(deepseek_models[name])
            out |= {(name, tuple(p), n): hf_greedy(model, p, n) for p, n in jobs}
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mesh(nats_server, deepseek_models, tmp_path_factory):
    """``mesh up`` of the tiny DeepSeek on the test's nats-server: (url, its hash key, a watcher's
    view once every worker is up)."""
    key = generate_hash_key()
    key_file = tmp_path_factory.mktemp("ds-key") / "hash.key"
    key_file.write_text(key.hex() + "\n")
    proc, url = start_up(
        "--nats", nats_server.url, "--ns", NS, *(a for m in MODELS for a in ("--model", str(deepseek_models[m]))),
        "--prefill", "1",
        "--decode", "2", "--no-planner", "--transports", "shm", "--disagg-threshold", str(THRESHOLD),
        "--speculative", "ngram", "--num-speculative-tokens", "3", "--block-size", str(BS),
        "--device-kv-blocks", "24", "--host-kv-blocks", "64", "--peer-fetch", "--hash-key-file", str(key_file),
        timeout=240)  # six workers on two shared cores: mesh up itself gives them 120 s after it spawned them
    try:
        async def ready():
            w = await Watcher.open(nats_server.url, ns=NS)
            try:
                cards = []
                for m in MODELS:
                    await w.wait_workers("decode", 2, m, timeout=180)
                    prefill = await w.wait_workers("prefill", 1, m, timeout=180)
                    await w.fresh_load(prefill[0].worker_id, timeout=30)  # the decode workers heard it too
                    cards += w.membership.cards(m)
                return cards
            finally:
                await w.close()

        cards = asyncio.run(ready())
        yield SimpleNamespace(url=url, key=HashKey.from_file(key_file), nats=nats_server.url, cards=cards)
    finally:
        stop_processes([proc])


async def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, model: str = MODEL,
                   **extra) -> tuple[list[int], str, int]:
    """(token ids, text, cached prompt tokens) of one greedy completion through the ``openai`` client."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    details = r.usage.prompt_tokens_details
    return (r.choices[0].model_extra or {})["token_ids"], r.choices[0].text, details.cached_tokens if details else 0


async def counters(w: Watcher, mesh) -> dict[str, dict[str, int]]:
    """Each model's workers' counters added up, from a load report of each sent after now."""
    out: dict[str, dict[str, int]] = {m: {} for m in MODELS}
    reports = await asyncio.gather(*(w.fresh_load(c.worker_id) for c in mesh.cards))
    for card, r in zip(mesh.cards, reports, strict=True):
        for k, v in r.counters.items():
            out[card.model][k] = out[card.model].get(k, 0) + v
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


async def watching(mesh) -> Watcher:
    return await Watcher.open(mesh.nats, ns=NS)


async def test_aggregated_and_disaggregated_over_shm_are_transformers(mesh, hf):
    w = await watching(mesh)
    try:
        spec_bytes = 3 * 1 * BS * 1 * (32 + 16) * 4  # layers x one latent plane x tokens x (latent + rope) x fp32
        assert {c.kv_block_bytes for c in mesh.cards} == {spec_bytes}  # what the router costs a block by
        before = await counters(w, mesh)
        jobs = [(m, p) for m in MODELS for p in SHORT + LONG]
        got = await asyncio.gather(*(complete(mesh.url, p, model=m, speculate=False) for m, p in jobs))
        for (m, p), (tokens, _, _) in zip(jobs, got, strict=True):
            assert tokens == hf[m, tuple(p), MAX_TOKENS], f"{m}: prompt of {len(p)} tokens"
        # each long prompt's latent blocks went over shm: the decode side and the prefill side count it
        for m, after in (await counters(w, mesh)).items():
            d = delta(after, before[m])
            assert d.get("remote_prefill_done", 0) == len(LONG) and d.get("transport_shm", 0) == 2 * len(LONG), (m, d)
            assert d.get("spec_drafted:ngram", 0) == 0, (m, d)
    finally:
        await w.close()


async def test_ngram_speculation_and_prefix_cache_hits_are_transformers(mesh, hf):
    w = await watching(mesh)
    try:
        before = await counters(w, mesh)
        jobs = [(m, p) for m in MODELS for p in REPEATING]
        got = await asyncio.gather(*(complete(mesh.url, p, model=m) for m, p in jobs))
        for (m, p), (tokens, _, _) in zip(jobs, got, strict=True):
            assert tokens == hf[m, tuple(p), MAX_TOKENS], f"{m}: prompt of {len(p)} tokens"
        for m, after in (await counters(w, mesh)).items():
            d = delta(after, before[m])
            assert d.get("spec_drafted:ngram", 0) > 0, (m, d)  # verified (the random model rarely accepts them)
        # sent again, each model's prompt is in one of its decode workers' cache
        again = await asyncio.gather(*(complete(mesh.url, REPEATING[1], model=m) for m in MODELS))
        for m, (tokens, _, cached) in zip(MODELS, again, strict=True):
            assert tokens == hf[m, tuple(REPEATING[1]), MAX_TOKENS], m
            assert cached == len(REPEATING[1]) // BS * BS, (m, cached)
    finally:
        await w.close()


async def test_a_json_schema_is_valid_and_the_same_with_and_without_drafts(mesh):
    prompt = REPEATING[1]  # long: its first token is sampled on the prefill worker, under the grammar
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    plain, text, _ = await complete(mesh.url, prompt, 60, response_format=fmt, speculate=False, ignore_eos=False)
    jsonschema.validate(json.loads(text), SCHEMA)
    drafted, text_drafted, _ = await complete(mesh.url, prompt, 60, response_format=fmt, ignore_eos=False)
    assert (drafted, text_drafted) == (plain, text)


async def test_a_prefix_in_one_workers_host_tier_is_fetched_by_the_other(mesh):
    w = await watching(mesh)
    router = KvRouter(w.bus, w.membership, RouterConfig(peer_fetch=True, hash_key=mesh.key))  # hashes as the mesh
    await router.start()
    try:
        a, b = sorted(c.worker_id for c in mesh.cards if c.role == "decode" and c.model == MODEL)
        before = (await w.fresh_load(b)).counters
        prompt, cold = await prefix_in_host_tier(w, router, a, random.Random(5), model=MODEL, key=mesh.key)
        d = router.route(MODEL, prompt, "moved", exclude={a})
        assert (d.worker_id, d.fetch_source, d.fetch_blocks) == (b, a, PREFIX_BLOCKS)
        tokens, cached = await ask(w.bus, b, prompt, router, plan_of(d), "moved", model=MODEL)
        assert tokens == cold and cached == PREFIX_BLOCKS * BS
        got = delta((await w.fresh_load(b)).counters, before)
        assert (got.get("peer_fetch_ok"), got.get("hit_blocks_peer")) == (1, PREFIX_BLOCKS), got
    finally:
        await router.stop()
        await w.close()


async def migrated_stream(mesh, w: Watcher, model: str, chosen: list[str]) -> list[int]:
    """Every token id of one greedy stream of ``model`` whose decode worker is killed (-9) mid-way
    (the router's last choice among ``model``'s decode workers: the other model's stream runs too)."""
    pids = {c.worker_id: c.pid for c in mesh.cards if c.role == "decode" and c.model == model}
    got, killed = [], None
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        stream = await client.completions.create(
            model=model, prompt=MIGRATED, max_tokens=MIGRATED_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            for choice in chunk.choices:
                got += (choice.model_extra or {}).get("token_ids") or []
            if killed is None and len(got) >= 8:
                ours = await w.wait_for(lambda: [x for x in chosen if x in pids], 10, "the router's decision")
                killed = ours[-1]
                os.kill(pids[killed], signal.SIGKILL)
    assert killed is not None
    return got


async def test_a_decode_worker_killed_mid_stream_migrates_and_the_tokens_stay_transformers(mesh, hf):
    """Last: it kills a decode worker of each model (``mesh up`` starts another in its place), both
    streams at once (the gateway notices each death when its card expires: one wait, not two)."""
    w = await watching(mesh)
    try:
        chosen = await router_choices(w)
        got = await asyncio.gather(*(migrated_stream(mesh, w, model, chosen) for model in MODELS))
        for model, tokens in zip(MODELS, got, strict=True):
            assert tokens == hf[model, tuple(MIGRATED), MIGRATED_TOKENS], model  # none lost, none repeated
        async with httpx.AsyncClient(timeout=10) as client:  # one each: a stream that did not move would be short
            assert f"pdmesh_gateway_migrations_total {len(MODELS)}" in (await client.get(f"{mesh.url}/metrics")).text
    finally:
        await w.close()
