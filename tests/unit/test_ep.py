"""Expert parallelism in one process tree: ``--ep 2`` engines (rank 0 here, the other rank a helper
process over gloo) against ``--ep 1`` on Qwen3-MoE, Mixtral and the tiny DeepSeek-V3 (and against
transformers for DeepSeek), ``--ep 2 --tp 2`` on Qwen3-MoE, the per-expert token counts, the
layouts, and what is refused in one line."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.moe import SparseMoE
from engine.parallel.group import ParallelGroupError
from engine.parallel.layout import Layout
from engine.sampling import SamplingParams
from mesh.errors import ModelError
from mesh.metrics import ExpertTokens, ExpertTokensCollector
from mesh.protocol import WorkerLayout
from tests.helpers.checkpoints import make_moe_checkpoint
from tests.helpers.references import hf_greedy, hf_model, prompts_of, run_with_logits

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 70]
KW = dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=64)  # the 70-token prompt takes two chunks


@pytest.fixture(scope="module")
def models(tmp_path_factory, deepseek_models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    return {"qwen3_moe": make_moe_checkpoint("qwen3_moe", root / "qwen3_moe"),
            "mixtral": make_moe_checkpoint("mixtral", root / "mixtral"),
            "deepseek": deepseek_models["deepseek"]}


@pytest.fixture(scope="module")
def ep1(models):
    """``ep1(family)``: the ``--ep 1`` engine's run of the family's prompts (once per family):
    (prompts, outputs, every step's logits, per-expert counts)."""
    runs = {}

    def run(family: str):
        if family not in runs:
            mc = ModelConfig.from_dir(models[family])
            prompts = prompts_of(LENGTHS, mc.vocab_size, seed=4, low=3)
            one = Engine(EngineConfig(models[family], **KW))
            out, _, logits = run_with_logits(one, prompts, GREEDY)
            runs[family] = prompts, out, logits, one.expert_token_counts()
        return runs[family]

    return run


def forwarded_tokens(prompts, params: SamplingParams) -> int:
    """Tokens a generate call runs through the model: every prompt token, and every output token
    but the last (no prefix-cache hits among ``prompts``)."""
    return sum(len(p) + params.max_tokens - 1 for p in prompts)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek"])
def test_ep2_is_token_identical_to_ep1_and_counts_the_same_expert_load(models, ep1, family):
    """Rank 1 holds the second half of every MoE layer's routed experts and nothing else; rank 0
    the first half, attention, the KV, the router and the shared experts. Chunked prefill and
    batched decode; the logits agree to float noise, the tokens exactly, and both count the
    same pairs per expert: every forwarded token top-k times per MoE layer. When the rank of
    experts only dies, the next step fails and so does every later one."""
    path = models[family]
    mc = ModelConfig.from_dir(path)
    prompts, out1, logits1, counts1 = ep1(family)
    two = Engine(EngineConfig(path, ep=2, **KW))
    try:
        assert two.layout.describe() == "tp 1 x ep 2" and len(two.ranks.pids) == 1
        moe = next(m for m in two.model.modules() if isinstance(m, SparseMoE))
        assert moe.local_experts == range(mc.moe.num_experts // 2) and moe.inter == mc.moe.intermediate_size
        out2, _, logits2 = run_with_logits(two, prompts, GREEDY)
        counts = two.expert_token_counts()
        # the rank of experts only dies: the next step fails (nothing hangs), and every later one
        os.kill(two.ranks.pids[0], signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(ParallelGroupError):
                two.generate([prompts[0]], GREEDY)
    finally:
        two.close()
    assert out2 == out1
    for a, b in zip(logits1, logits2, strict=True):
        assert (a - b).abs().max().item() < 1e-5
    assert counts == counts1
    assert sorted(counts) == list(mc.moe.sparse_layers)
    assert all(sum(c) == forwarded_tokens(prompts, GREEDY) * mc.moe.top_k for c in counts.values())
    if family == "deepseek":  # the issue's reference: transformers' generate
        ref = hf_model(path)
        assert out2 == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]


def test_ep2_tp2_is_token_identical_to_ep1(models, ep1):
    """Two ranks: attention split by heads as at --tp 2, experts split by expert; each rank routes
    and dispatches its half of the step's tokens (the last decode steps, of one row, leave rank 0
    none)."""
    prompts, want, _, counts = ep1("qwen3_moe")
    two = Engine(EngineConfig(models["qwen3_moe"], tp=2, ep=2, **KW))
    try:
        assert two.layout.describe() == "tp 2 x ep 2" and two.layout.size == 2
        assert [s.output_token_ids for s in two.generate(prompts, GREEDY)] == want
        assert two.expert_token_counts() == counts
        assert two.generate([prompts[0]], GREEDY)[0].output_token_ids == want[0]  # every step one row
    finally:
        two.close()


# -- layouts -------------------------------------------------------------------------------


def test_layouts_place_the_ranks_that_hold_experts_only_after_the_tp_group():
    lay = Layout.for_model(2, 1, 3, ep=4)
    assert (lay.width, lay.size, lay.describe()) == (4, 4, "tp 2 x ep 4")
    assert [(p.tp_rank, p.ep_rank, p.experts_only) for p in map(lay.place, range(4))] == [
        (0, 0, False), (1, 1, False), (None, 2, True), (None, 3, True)]
    assert lay.stage_ranks(0) == (0, 1) and lay.expert_ranks(0) == (0, 1, 2, 3)
    assert Layout.for_model(2, 1, 3).expert_ranks(0) == ()
    card = WorkerLayout(tp=1, ep=2)
    assert (card.ranks, card.describe()) == (2, "tp1xep2")
    assert (WorkerLayout(tp=2, ep=2).ranks, WorkerLayout(tp=2, ep=2).describe()) == (2, "tp2xep2")


@pytest.mark.parametrize(("family", "fields", "error", "match"), [
    ("qwen3_moe", {"ep": 3}, ModelError, "--ep 3 must divide the model's 8 routed experts"),
    ("mixtral", {"ep": 4}, ModelError, "--ep 4 must divide the model's 6 routed experts"),
    ("dense", {"ep": 2}, ModelError, "--ep 2 needs a mixture-of-experts model; llama is dense"),
    ("mixtral", {"ep": 3, "tp": 2}, ValueError, "--ep 3 must be a multiple of --tp 2"),
    ("qwen3_moe", {"ep": 2, "pp": 2}, ValueError, "--ep 2 does not run with --pp 2 yet"),
    ("qwen3_moe", {"ep": 2, "async_scheduling": True}, ValueError, "--async-scheduling is not supported with"),
    ("deepseek", {"ep": 2, "tp": 2}, ModelError, "--tp 2 is not supported for MLA models"),
])
def test_what_ep_does_not_run_is_refused_at_start(models, tiny_model, family, fields, error, match):
    path = tiny_model if family == "dense" else models[family]
    with pytest.raises(error, match=match):
        Engine(EngineConfig(path, num_kv_blocks=16, **fields))


@pytest.mark.parametrize(("argv", "error"), [
    (["--ep", "4"], "--ep 4 must divide the model's 6 routed experts"),
    (["--ep", "2", "--pp", "2"], "--ep 2 does not run with --pp 2 yet"),
])
def test_a_worker_refuses_what_ep_does_not_run_in_one_line(models, capsys, argv, error):
    """Before it joins any bus (the address here answers nothing)."""
    from cli import main

    rc = main(["worker", "decode", "--model", str(models["mixtral"]), "--nats", "nats://127.0.0.1:9", *argv])
    assert rc == 2 and capsys.readouterr().err.strip() == f"mesh: error: {error}"


def test_expert_token_counter_exposition():
    registry = CollectorRegistry()
    latest = ExpertTokens("m", "decode", {1: [3, 0], 2: [1, 2]})
    registry.register(ExpertTokensCollector(lambda: latest))
    text = generate_latest(registry).decode()
    assert re.search(r"^# TYPE pdmesh_moe_expert_tokens(_total)? counter$", text, re.M)
    assert 'pdmesh_moe_expert_tokens_total{expert="0",layer="1",model="m",role="decode"} 3.0' in text
    assert 'pdmesh_moe_expert_tokens_total{expert="1",layer="2",model="m",role="decode"} 2.0' in text
    latest = ExpertTokens("m", "decode", {})
    assert "pdmesh_moe_expert_tokens" not in generate_latest(registry).decode()
