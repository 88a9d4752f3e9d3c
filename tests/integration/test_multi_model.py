"""Two models on one mesh: one `mesh up`, one gateway, a pool pair and a planner per model."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.tiny import write_tiny_model
from tests.helpers.cluster import start_up


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    return write_tiny_model(root / "alpha", seed=0), write_tiny_model(root / "beta", seed=1)


async def test_two_models_are_served_side_by_side(two_models):
    alpha, beta = two_models
    proc, url = start_up("--model", str(alpha), "--model", str(beta), "--prefill", "0", "--decode", "2",
                         "--no-planner", "--device-kv-blocks", "512")
    try:
        rng = random.Random(3)
        prefix = [rng.randrange(3, 4000) for _ in range(200)]
        prompts = {"alpha": prefix + [5, 6], "beta": prefix + [7, 8]}
        async with httpx.AsyncClient(timeout=60) as client:
            models = (await client.get(f"{url}/v1/models")).json()["data"]
            assert sorted(m["id"] for m in models) == ["alpha", "beta"]
            out = {}
            for name, prompt in prompts.items():
                r = await client.post(f"{url}/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                out[name] = r.json()["choices"][0]["token_ids"]
            # load on alpha does not move beta's requests off the worker holding beta's prefix
            flood = [client.post(f"{url}/v1/completions", json={
                "model": "alpha", "prompt": [rng.randrange(3, 4000) for _ in range(300)], "max_tokens": 64,
                "ignore_eos": True}) for _ in range(12)]
            again = client.post(f"{url}/v1/completions", json={
                "model": "beta", "prompt": prefix + [9], "max_tokens": 4, "temperature": 0})
            results = await asyncio.gather(*flood, again)
            assert all(r.status_code == 200 for r in results)
            assert results[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
            assert (await client.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "x"})).status_code == 404
        for name, path in (("alpha", alpha), ("beta", beta)):
            ref = Engine(EngineConfig(path, num_kv_blocks=256)).generate(
                [prompts[name]], SamplingParams(max_tokens=12, temperature=0.0))[0]
            assert out[name] == ref.output_token_ids
        assert out["alpha"] != out["beta"]  # two different models, really
    finally:
        proc.send_signal(2)
        assert proc.wait(90) == 0
