"""``--speculative mtp`` served (issue 49): ``mesh up`` on the tiny DeepSeek-V3 as a user runs it
(one prefill and one decode worker, the decode worker drafting with the checkpoint's MTP layer,
a fixed K: a random layer's drafts are almost never accepted), and the official ``openai`` client.
Greedy outputs are transformers' for prompts prefilled where they decode (aggregated) and for
prompts the prefill worker computed (disaggregated: their latent KV came over shm, and the
decode worker rebuilt the target's states of their tokens to draft from); the decode worker's
load report counts what it drafted. ``mesh up`` refuses ``--speculative mtp`` on a checkpoint
without an MTP layer in one line, before it starts anything."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import openai

from tests.helpers.cluster import Watcher, start_up
from tests.helpers.references import hf_greedy, hf_model, prompts_of

THRESHOLD = 24  # prompts this long are prefilled by the prefill worker
MAX_TOKENS = 8


async def decode_counters(nats_url: str) -> dict[str, int]:
    """The decode worker's counters, from a load report sent after this call (and after the prefill
    worker is serving: ``mesh up`` is up once its gateway and decode workers are, and a long prompt
    that comes before the prefill worker's card is prefilled where it decodes)."""
    w = await Watcher.open(nats_url)
    try:
        await w.wait_for(lambda: w.membership.cards(role="decode"), 60, "the decode worker")
        await w.wait_for(lambda: [c for c in w.membership.cards(role="prefill") if c.status == "ready"], 120,
                         "the prefill worker")
        (card,) = w.membership.cards(role="decode")
        return (await w.fresh_load(card.worker_id, timeout=30)).counters
    finally:
        await w.close()


async def test_mesh_up_serves_mtp_drafts_aggregated_and_disaggregated(deepseek_models):
    path = deepseek_models["deepseek"]
    short = prompts_of([6, 11], 4000, seed=5, low=3)
    long = prompts_of([30, 41], 4000, seed=6, low=3)
    ref = hf_model(path)
    want = [hf_greedy(ref, p, MAX_TOKENS) for p in short + long]
    proc, url = start_up("--model", str(path), "--speculative", "mtp", "--num-speculative-tokens", "2",
                         "--no-speculative-adaptive", "--no-planner", "--disagg-threshold", str(THRESHOLD),
                         "--device-kv-blocks", "64", "--transports", "shm")
    try:
        nats_url = re.search(r"NATS (\S+?)\)", proc.up_line).group(1)
        before = await decode_counters(nats_url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
        done = await asyncio.gather(*(client.completions.create(
            model=path.name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}) for p in short + long))
        got = [r.choices[0].model_extra["token_ids"] for r in done]
        assert got == want
        after = await decode_counters(nats_url)
        delta = {k: v - before.get(k, 0) for k, v in after.items()}
        # every row drafted K = 2 at each decoding step but the last two (where max_tokens leaves less)
        assert delta.get("spec_drafted:mtp", 0) >= len(got) * 2 * (MAX_TOKENS - 3), delta
        assert delta.get("spec_emitted:mtp", 0) >= len(got) * (MAX_TOKENS - 2), delta
        assert delta.get("remote_prefill_done", 0) >= len(long), delta  # the long ones were disaggregated
        # their states were rebuilt where they decode (the short ones were computed there)
        assert delta.get("spec_rebuilt:mtp", 0) >= sum(len(p) - 1 for p in long), delta
    finally:
        proc.send_signal(2)
        assert proc.wait(90) == 0


def test_mesh_up_refuses_mtp_without_the_layer_in_one_line(tiny_model):
    r = subprocess.run([sys.executable, "-m", "cli", "up", "--model", str(tiny_model), "--speculative", "mtp"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a llama checkpoint, which has none" in lines[0], r.stderr
