"""Multi-LoRA through the whole mesh: the official openai client against the gateway, real
decode and prefill worker processes, adapters made by peft on the tiny model, and transformers
+ peft as the reference.

One mesh for the module: ``lora-dec`` (decode, holds the adapters, prefills long prompts on the
prefill worker), ``lora-pre`` (prefill, same adapters), ``base-dec`` (decode, LoRA on but no
adapter until one is loaded at runtime), one gateway with the KV router.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from tests.helpers.cluster import Watcher, router_choices, stream_killing_its_worker, wait_http_ok
from tests.helpers.lora import ADAPTERS, peft_references
from tests.helpers.references import prompts_of

MAX_TOKENS = 8
THRESHOLD = 48  # lora-dec prefills prompts this long on the prefill worker
LENGTHS = (9, 30, 70)  # 70: disaggregated
DEC, PRE, BASE = "lora-dec", "lora-pre", "base-dec"


def ids(n: int, seed: int) -> list[int]:
    return prompts_of([n], 4000, seed, low=3)[0]


PROMPTS = [ids(n, 100 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """PEFT adapters on the tiny model, and transformers + peft greedy outputs of every prompt
    under each (key None: the base model)."""
    dirs, expected = peft_references(tiny_model, tmp_path_factory.mktemp("lora-serving"), PROMPTS, MAX_TOKENS)
    assert len({str(v) for v in expected.values()}) == 4  # every adapter changes the output
    return dirs, expected


@pytest.fixture(scope="module")
def mesh(cluster, tiny_model, adapters):
    dirs, _ = adapters
    common = ["--model", str(tiny_model), "--device-kv-blocks", "256", "--transports", "shm"]
    loras = [arg for name, d in dirs.items() for arg in ("--lora", f"{name}={d}")]
    cluster.worker("decode", *common, *loras, "--disagg-threshold", str(THRESHOLD), "--worker-id", DEC)
    cluster.worker("prefill", *common, *loras, "--prefill-capacity", "8", "--worker-id", PRE)
    cluster.worker("decode", *common, "--max-loras", "2", "--disagg-threshold", "100000", "--worker-id", BASE)
    url = cluster.gateway(tiny_model, None, "--insecure-admin")  # no keys here: the admin routes opened

    async def ready():
        w = await Watcher.open(cluster.nats_url)
        try:
            await w.wait_for(lambda: all(w.membership.get(x) for x in (DEC, PRE, BASE)), 180, "workers")
            await w.fresh_load(PRE)  # the decode worker has heard the prefill pool
        finally:
            await w.close()

    asyncio.run(ready())
    wait_http_ok(url + "/health", 60)
    return url, cluster.nats_url


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh[0] + "/v1", api_key="x", max_retries=0, timeout=120)


@asynccontextmanager
async def counters(mesh):
    """Each worker's counters before and after the block: ``after[w][k] - before[w][k]``."""
    w = await Watcher.open(mesh[1])
    delta: dict[str, dict[str, int]] = {}
    try:
        before = {x: (await w.fresh_load(x)).counters for x in (DEC, PRE, BASE)}
        yield delta
        for x in (DEC, PRE, BASE):
            after = (await w.fresh_load(x)).counters
            delta[x] = {k: v - before[x].get(k, 0) for k, v in after.items()}
    finally:
        await w.close()


async def complete(client, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return (r.choices[0].model_extra or {})["token_ids"], r.usage


async def test_models_lists_adapters_with_their_base(client):
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {"tiny", *ADAPTERS}
    assert (models["tiny"].model_extra or {})["parent"] is None
    for name in ADAPTERS:
        assert (models[name].model_extra or {})["parent"] == "tiny"


async def test_a_mixed_batch_of_three_adapters_and_the_base_equals_peft(client, adapters, mesh):
    """Every prompt under every adapter and the base at once; the long prompt is prefilled by the
    prefill worker with the same adapter; adapter requests go only where the adapter is."""
    _, expected = adapters
    jobs = [(name, i) for name in [None, *ADAPTERS] for i in range(len(PROMPTS))]
    async with counters(mesh) as delta:
        results = await asyncio.gather(*(complete(client, name or "tiny", PROMPTS[i]) for name, i in jobs))
    for (name, i), (tokens, _) in zip(jobs, results, strict=True):
        assert tokens == expected[name][i], f"{name or 'base'}, prompt of {LENGTHS[i]} tokens"
    adapter_jobs = len(ADAPTERS) * len(PROMPTS)
    assert delta[DEC]["requests"] >= adapter_jobs and delta[BASE]["requests"] <= len(PROMPTS)
    assert delta[DEC].get("remote_prefill_done", 0) >= len(ADAPTERS), delta[DEC]  # 70 tokens on each adapter
    assert delta[PRE].get("prefill_tokens", 0) > 0


async def test_router_sends_an_adapters_requests_to_the_worker_that_holds_it(client, mesh):
    async with counters(mesh) as delta:
        for seed in range(4):
            await complete(client, "mlp", ids(20, 900 + seed), max_tokens=2)
    assert delta[DEC]["requests"] == 4 and delta[BASE]["requests"] == 0


async def test_prefix_cache_is_per_adapter(client):
    prompt = ids(40, 7)  # two full blocks of 16
    _, first = await complete(client, "all", prompt, 2)
    _, other = await complete(client, "attn", prompt, 2)
    _, again = await complete(client, "all", prompt, 2)
    cached = [u.prompt_tokens_details.cached_tokens for u in (first, other, again)]
    assert cached == [0, 0, 32], cached


async def test_unknown_adapter_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        await complete(client, "no-such-adapter", PROMPTS[0])
    assert e.value.body["code"] == "model_not_found" and "no-such-adapter" in e.value.body["message"]


async def test_runtime_load_and_unload_through_the_admin_endpoints(client, adapters, mesh, tmp_path):
    dirs, expected = adapters
    async with httpx.AsyncClient(base_url=mesh[0], timeout=60) as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(dirs["attn"])})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
        assert "late" in {m.id for m in (await client.models.list()).data}
        results = await asyncio.gather(*(complete(client, "late", p) for p in PROMPTS[:2] * 2))
        assert [t for t, _ in results] == expected["attn"][:2] * 2  # on both decode workers now
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
        assert "late" not in {m.id for m in (await client.models.list()).data}
        with pytest.raises(openai.NotFoundError):
            await complete(client, "late", PROMPTS[0])
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(broken)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "adapter_model.safetensors" in error["message"] and "\n" not in error["message"]
        assert error["param"] == "lora_path"
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


async def test_with_api_keys_only_admin_keys_manage_adapters(cluster, tiny_model, adapters, mesh, tmp_path):
    """A gateway with keys: a user key may complete but not load or unload (403
    ``permission_denied``), no key is a 401, an admin key (flag or key file ``role=admin``) may."""
    dirs, expected = adapters
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("sk-user-0123456789 name=tenant\nsk-ops-0123456789 name=ops role=admin\n")
    base = cluster.gateway(tiny_model, None, "--api-key-file", str(keyfile), "--admin-api-key", "sk-admin-0123456789")
    wait_http_ok(f"{base}/health", 90)
    load = {"lora_name": "keyed", "lora_path": str(dirs["mlp"])}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        user = {"Authorization": "Bearer sk-user-0123456789"}
        r = await http.post("/v1/load_lora_adapter", json=load, headers=user)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "permission_denied" and "role=admin" in r.json()["error"]["message"]
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=user)
        assert r.status_code == 403
        for admin in ("sk-admin-0123456789", "sk-ops-0123456789"):
            r = await http.post("/v1/load_lora_adapter", json=load, headers={"Authorization": f"Bearer {admin}"})
            assert r.status_code == 200, r.text
            keyed = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-user-0123456789", max_retries=0)
            text, _ = await complete(keyed, "keyed", PROMPTS[0])
            assert text == expected["mlp"][0]  # the user key serves the adapter the admin loaded
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "keyed"},
                                headers={"Authorization": f"Bearer {admin}"})
            assert r.status_code == 200, r.text


def test_a_broken_adapter_directory_is_one_line_naming_the_file(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "cli", "worker", "decode", "--nats", "nats://127.0.0.1:9",
                        "--model", str(tiny_model), "--lora", f"x={broken}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("mesh: error:") and str(broken / "adapter_config.json") in line


async def test_an_adapter_request_migrates_when_its_worker_dies(cluster, tiny_model, adapters, mesh):
    """Last in the module (it kills a decode worker): the adapter is loaded on both decode
    workers; the one streaming is killed; the gateway resumes the request on the other, on the
    same adapter, and the client sees the engine's output unbroken."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    dirs, _ = adapters
    url, nats_url = mesh
    prompt, n = ids(40, 11), 400
    w = await Watcher.open(nats_url)
    try:
        chosen = await router_choices(w)  # 400 tokens can end before a load report says where they run
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "mig", "lora_path": str(dirs["mlp"])})
            assert r.status_code == 200, r.text
        workers = {x: next(p for p in cluster.procs if x in p.args) for x in (DEC, BASE)}
        got, _ = await stream_killing_its_worker(url, "mig", prompt, n, w, workers, after=20, chosen=chosen)
        engine = Engine(EngineConfig(tiny_model, num_kv_blocks=256, loras=(("mig", str(dirs["mlp"])),)))
        want = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), lora="mig")
        assert got == want[0].output_token_ids  # no token lost, none repeated, the adapter kept
    finally:
        await w.close()
