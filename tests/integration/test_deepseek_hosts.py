"""The tiny DeepSeek-V3 (latent KV blocks) across simulated hosts (``tests.helpers.hostbed``), in
both its configs: ``deepseek-fp8`` (q_lora_rank set, block-quantized FP8 weights) prefilled on
host 2 and decoded on host 3, ``deepseek-yarn`` (q_lora_rank null, YaRN) the other way round; the
gateway on host 1. Greedy outputs through the official ``openai`` client equal transformers'
generate (on the dequantized weights for FP8); every long prompt's latent blocks crossed over
nixl, none over shm (which needs one /dev/shm) or the nats fallback."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.checkpoints import dequantized_copy
from tests.helpers.multihost import completion_ids, open_watcher, wait_gateway
from tests.helpers.references import hf_greedy, hf_model, prompts_of

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

# served name (the checkpoint's directory) -> (prefill host, decode host)
PLACES = {"deepseek-fp8": (2, 3), "deepseek-yarn": (3, 2)}
THRESHOLD = 48
LENGTHS = [9, 30, 60, 150]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(deepseek_models, tmp_path_factory):
    """(prompts, {model: transformers' greedy tokens}), FP8 on the dequantized weights."""
    plain = dequantized_copy(deepseek_models["deepseek-fp8"], tmp_path_factory.mktemp("ds-plain") / "plain")
    prompts = prompts_of(LENGTHS, 4000, seed=21, low=3)
    refs = {"deepseek-fp8": hf_model(plain), "deepseek-yarn": hf_model(deepseek_models["deepseek-yarn"])}
    return prompts, {m: [hf_greedy(model, p, MAX_TOKENS) for p in prompts] for m, model in refs.items()}


async def test_deepseek_disaggregated_over_nixl_between_hosts_is_transformers(hostbed, deepseek_models, reference):
    prompts, expected = reference
    for m, (pre, dec) in PLACES.items():
        flags = ["--model", str(deepseek_models[m]), "--device-kv-blocks", "128", "--transports", "shm,nixl,nats"]
        hostbed.worker(pre, "prefill", *flags, "--worker-id", f"{m}-pre", "--prefill-capacity", "4")
        hostbed.worker(dec, "decode", *flags, "--worker-id", f"{m}-dec", "--disagg-threshold", str(THRESHOLD))
    url = hostbed.gateway(1, *(a for m in PLACES for a in ("--model", str(deepseek_models[m]))))
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        ids = [f"{m}-{r}" for m in PLACES for r in ("pre", "dec")]
        await w.wait_for(lambda: all(w.membership.get(i) for i in ids), 120, "every worker")
        for m in PLACES:
            await w.fresh_load(f"{m}-pre", timeout=30)  # its decode worker has heard the prefill pool too
            assert "nixl" in w.membership.get(f"{m}-dec").transports
        await wait_gateway(url)
        jobs = [(m, p) for m in PLACES for p in prompts]
        got = await asyncio.gather(*(completion_ids(url, p, MAX_TOKENS, model=m) for m, p in jobs))
        assert {m: [g for (jm, _), g in zip(jobs, got, strict=True) if jm == m] for m in PLACES} == expected
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        for m in PLACES:
            dec, pre = (await w.fresh_load(f"{m}-dec")).counters, (await w.fresh_load(f"{m}-pre")).counters
            assert dec.get("remote_prefill_done") == long_ones and dec.get("transport_nixl") == long_ones, (m, dec)
            assert pre.get("transport_nixl") == long_ones, (m, pre)
            assert not any(c.get(f"transport_{t}") for c in (dec, pre) for t in ("shm", "nats")), (m, dec, pre)
    finally:
        await w.close()
