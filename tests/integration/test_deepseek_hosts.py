"""The FP8 tiny DeepSeek-V3 (block-quantized weights, latent KV blocks) across simulated hosts
(``tests.helpers.hostbed``): the gateway on host 1, a prefill worker on host 2, a decode worker on
host 3, its latent blocks between hosts over nixl. Greedy outputs through the official ``openai``
client equal transformers' generate on the dequantized weights; every long prompt's KV crossed
over nixl, none over shm (which needs one /dev/shm) or the nats fallback."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import dequantized_copy
from tests.helpers.multihost import completion_ids, open_watcher, wait_gateway
from tests.helpers.references import hf_greedy, hf_model, prompts_of

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

MODEL = "deepseek-fp8"  # the served name: the checkpoint's directory
THRESHOLD = 48
LENGTHS = [9, 30, 60, 150]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(deepseek_models, tmp_path_factory):
    """(prompts, transformers' greedy tokens on the dequantized weights)."""
    model = hf_model(dequantized_copy(deepseek_models[MODEL], tmp_path_factory.mktemp("ds-plain") / "plain"))
    prompts = prompts_of(LENGTHS, 4000, seed=21, low=3)
    return prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


async def test_fp8_deepseek_disaggregated_over_nixl_between_hosts_is_transformers(hostbed, deepseek_models,
                                                                                  reference):
    prompts, expected = reference
    model = ["--model", str(deepseek_models[MODEL]), "--device-kv-blocks", "128", "--transports", "shm,nixl,nats"]
    hostbed.worker(2, "prefill", *model, "--worker-id", "ds-pre", "--prefill-capacity", "4")
    hostbed.worker(3, "decode", *model, "--worker-id", "ds-dec", "--disagg-threshold", str(THRESHOLD))
    url = hostbed.gateway(1, "--model", str(deepseek_models[MODEL]))
    w = await open_watcher(hostbed.hosts[1].nats_url)
    try:
        await w.wait_for(lambda: w.membership.get("ds-dec") and w.membership.get("ds-pre"), 120, "both workers")
        await w.fresh_load("ds-pre", timeout=30)  # the decode worker has heard the prefill pool too
        await wait_gateway(url)
        assert "nixl" in w.membership.get("ds-dec").transports
        got = [await completion_ids(url, p, MAX_TOKENS, model=MODEL) for p in prompts]
        assert got == expected
        long_ones = sum(1 for n in LENGTHS if n >= THRESHOLD)
        dec, pre = (await w.fresh_load("ds-dec")).counters, (await w.fresh_load("ds-pre")).counters
        assert dec.get("remote_prefill_done") == long_ones and dec.get("transport_nixl") == long_ones, dec
        assert pre.get("transport_nixl") == long_ones, pre
        assert not any(c.get(f"transport_{t}") for c in (dec, pre) for t in ("shm", "nats")), (dec, pre)
    finally:
        await w.close()
