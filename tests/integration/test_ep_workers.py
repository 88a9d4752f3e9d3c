"""Expert parallelism as real processes: a ``--ep 2`` decode worker (rank 0 the worker, rank 1 a
helper holding the second half of every MoE layer's routed experts, gloo between them) serving
the tiny DeepSeek-V3 behind a gateway, driven by the official ``openai`` client.

Greedy tokens equal transformers' generate; the card states the layout (``mesh top`` shows its
``describe()``, ``tp1xep2``: tests/unit/test_ep.py); the worker's ``/metrics`` count the tokens
each expert of each MoE layer took: every token the model ran, ``top_k`` times per layer.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from engine.config import ModelConfig
from mesh.protocol import WorkerLayout
from tests.helpers.cluster import Watcher, wait_http_ok
from tests.helpers.references import hf_greedy, hf_model, prompts_of

MAX_TOKENS = 8


def expert_tokens(text: str) -> dict[int, int]:
    """``pdmesh_moe_expert_tokens_total`` summed over the experts, per layer."""
    out: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdmesh_moe_expert_tokens_total":
                layer = int(s.labels["layer"])
                out[layer] = out.get(layer, 0) + int(s.value)
    return out


async def test_ep2_worker_serves_transformers_tokens_and_counts_each_experts_tokens(cluster, deepseek_models):
    path = deepseek_models["deepseek"]
    mc = ModelConfig.from_dir(path)
    ns, dec = "ep-agg", "dec-ep-agg"
    cluster.worker("decode", "--ns", ns, "--model", str(path), "--device-kv-blocks", "256", "--ep", "2",
                   "--max-num-batched-tokens", "64", "--worker-id", dec)
    url = cluster.gateway(path, None, "--ns", ns)
    prompts = prompts_of([5, 30, 90], mc.vocab_size, seed=11, low=3)
    ref = hf_model(path)
    want = [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]
    w = await Watcher.open(cluster.nats_url, ns=ns)
    try:
        card = await w.wait_for(lambda: w.membership.get(dec), 180, "the decode worker")
        assert card.layout == WorkerLayout(tp=1, ep=2)
        await asyncio.to_thread(wait_http_ok, f"{url}/health", 120)
        metrics = f"http://127.0.0.1:{card.metrics_port}/metrics"
        async with httpx.AsyncClient(timeout=30) as http:
            await w.fresh_load(dec)
            before = expert_tokens((await http.get(metrics)).text)  # the warm-up request's
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            replies = await asyncio.gather(*(
                client.completions.create(model=path.name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
                for p in prompts))
            assert [(r.choices[0].model_extra or {}).get("token_ids") for r in replies] == want
            await w.fresh_load(dec)
            after = expert_tokens((await http.get(metrics)).text)
        ran = sum(len(p) + MAX_TOKENS - 1 for p in prompts)  # every output token but the last is run
        assert sorted(after) == list(mc.moe.sparse_layers)
        assert {layer: after[layer] - before.get(layer, 0) for layer in after} == {
            layer: ran * mc.moe.top_k for layer in mc.moe.sparse_layers}
    finally:
        await w.close()
