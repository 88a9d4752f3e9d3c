"""The FlashInfer backends (``flashinfer``, ``flashinfer-ragged``) against the PyTorch reference
backend, on CUDA.

Backend level: one step of random q/k/v over a paged cache holding random
earlier context (decodes, chunks after a cached prefix, fresh prefills), every
output row checked against the torch backend run in float32 on the same cache,
and the written pages checked to be exactly the torch backend's.

Engine level: the ``small`` checkpoint (head_dim 64; the test suite's ``tiny``
has head_dim 16, which FlashInfer does not serve). Logits are compared against
a float32 engine, with the same-dtype torch engine's error as the yardstick;
greedy outputs must agree except where the float32 logits say the two choices
are a near tie.

Skips cleanly (collected, reported as skipped) without CUDA or flashinfer.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.attention import AttentionBatch, create_backend, default_backend
from engine.config import EngineConfig
from engine.engine import Engine
from kvstore.cache import KVCache, KVCacheSpec
from tests.helpers.greedy_checks import assert_greedy_agree, greedy, step_logits

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# (tokens already cached, tokens this step) per sequence; the long contexts make FlashInfer split the KV
LAYOUTS = {
    "mixed": [(37, 1), (16, 1), (0, 1), (32, 20), (7, 9), (0, 50), (0, 3), (700, 30)],
    "decode": [(37, 1), (16, 1), (0, 1), (100, 1), (5, 1), (1500, 1)],
    "prefill": [(0, 50), (32, 20), (7, 9), (0, 2)],
}
# attention output is a convex mix of V rows; bounds for float32 reference vs half precision
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_step(layout, block_size: int, num_blocks: int, seed: int) -> AttentionBatch:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    qlens, ctxs, tables, slots = [], [], [], []
    for cached, new in layout:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size) + 1)]  # one spare block past the context
        qlens.append(new)
        ctxs.append(ctx)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
    return AttentionBatch(qlens, ctxs, tables, torch.tensor(slots, dtype=torch.long, device=CUDA))


def run_step(backend_name, kv, batch, qkv):
    backend = create_backend(backend_name, kv, kv.spec.head_dim**-0.5)
    backend.plan(batch)
    return [backend.forward(layer, q, k, v) for layer, (q, k, v) in enumerate(qkv)]


FLASH_BACKENDS = ["flashinfer", "flashinfer-ragged"]


@pytest.mark.parametrize("backend", FLASH_BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_backend_matches_torch_reference(layout, dtype, heads, backend):
    dt = DTYPES[dtype]
    num_q, num_kv = heads
    spec = KVCacheSpec(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=num_kv, head_dim=64, dtype=dt)
    batch = make_step(LAYOUTS[layout], spec.block_size, spec.num_blocks, seed=0)
    g = torch.Generator(device=CUDA).manual_seed(0)
    earlier = torch.randn(spec.shape, generator=g, device=CUDA).to(dt)  # the cached context
    T = batch.num_tokens
    qkv = [
        tuple(torch.randn(T, h, spec.head_dim, generator=g, device=CUDA).to(dt) for h in (num_q, num_kv, num_kv))
        for _ in range(spec.num_layers)
    ]
    caches = {}
    for name, cache_dtype in [("flashinfer", dt), ("torch", dt), ("reference", torch.float32)]:
        kv = KVCache(replace(spec, dtype=cache_dtype), CUDA)
        kv.tensor.copy_(earlier)
        step = [tuple(t.to(cache_dtype) for t in layer) for layer in qkv]
        caches[name] = (kv, run_step({"reference": "torch", "flashinfer": backend}.get(name, name), kv, batch, step))

    (kv_f, out_f), (kv_t, out_t), (_, out_r) = caches["flashinfer"], caches["torch"], caches["reference"]
    tol = TOL[dt]
    for layer in range(spec.num_layers):
        assert out_f[layer].shape == (T, num_q, spec.head_dim) and out_f[layer].dtype == dt
        torch.testing.assert_close(out_f[layer].float(), out_r[layer], atol=tol, rtol=tol)
        torch.testing.assert_close(out_f[layer], out_t[layer], atol=2 * tol, rtol=2 * tol)
    # the new K/V went to exactly the slots the torch backend wrote, nothing else changed
    assert torch.equal(kv_f.tensor, kv_t.tensor)
    k_pages, v_pages = kv_f.layer(1)
    assert torch.equal(k_pages.reshape(-1, num_kv, spec.head_dim)[batch.slot_mapping], qkv[1][1])
    assert torch.equal(v_pages.reshape(-1, num_kv, spec.head_dim)[batch.slot_mapping], qkv[1][2])


def test_unsupported_head_dim_is_refused_with_the_reason():
    spec = KVCacheSpec(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        create_backend("flashinfer", KVCache(spec, CUDA), 0.25)


# -- engine level ----------------------------------------------------------------

PROMPT_LENS = [3, 17, 40, 64, 9, 100, 250]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(4096) for _ in range(n)] for n in PROMPT_LENS]


def make_engine(model, dtype, backend, **kw) -> Engine:
    # num_kv_blocks explicit: the automatic size takes most of the GPU, and tests hold several engines
    return Engine(EngineConfig(model, device="cuda", dtype=dtype, attention_backend=backend, num_kv_blocks=512, **kw))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_logits_match_a_float32_engine_as_closely_as_torch_does(small_model, prompts, dtype):
    ref, ref_seqs = step_logits(make_engine(small_model, "float32", "torch"), prompts, 2)
    same, same_seqs = step_logits(make_engine(small_model, dtype, "torch"), prompts, 2)
    flash, flash_seqs = step_logits(make_engine(small_model, dtype, "flashinfer"), prompts, 2)
    # step 0 prefills every prompt in one batch: every position of every prompt is a row
    assert ref[0].shape[0] == sum(PROMPT_LENS)
    err_t, err_f = (same[0] - ref[0]).abs(), (flash[0] - ref[0]).abs()
    assert err_f.max() <= 2 * err_t.max() + 0.05, (err_f.max().item(), err_t.max().item())
    assert err_f.mean() <= 2 * err_t.mean() + 0.01, (err_f.mean().item(), err_t.mean().item())
    # step 1 is a pure decode step (one row per sequence, in admission order); compare the rows whose
    # first sampled token agrees in all three engines, so the decode inputs are the same
    rows = [
        i for i, (a, b, c) in enumerate(zip(ref_seqs, same_seqs, flash_seqs, strict=True))
        if a.output_token_ids[0] == b.output_token_ids[0] == c.output_token_ids[0]
    ]
    assert len(rows) >= len(prompts) // 2
    err_t, err_f = (same[1][rows] - ref[1][rows]).abs(), (flash[1][rows] - ref[1][rows]).abs()
    assert err_f.max() <= 2 * err_t.max() + 0.05, (err_f.max().item(), err_t.max().item())


@pytest.mark.parametrize("backend", FLASH_BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_greedy_matches_torch_with_chunked_prefill_and_prefix_cache(small_model, prompts, dtype, backend):
    # a 64-token budget splits the long prompts into chunks that run beside other sequences' decodes
    ref = make_engine(small_model, "float32", "torch")
    ref_logits, _ = step_logits(ref, prompts, 1)
    same_logits, _ = step_logits(make_engine(small_model, dtype, "torch"), prompts, 1)
    margin = 2 * (same_logits[0] - ref_logits[0]).abs().max().item()  # this dtype's noise on the logits
    engines = {b: make_engine(small_model, dtype, b, max_num_batched_tokens=64) for b in ("flashinfer", "torch")}
    engines["flashinfer"] = make_engine(small_model, dtype, backend, max_num_batched_tokens=64)
    assert engines["flashinfer"].attention.name == backend
    runs = {b: e.generate(prompts, greedy(24)) for b, e in engines.items()}
    assert engines["flashinfer"].num_steps > 24 + 250 // 64
    assert_greedy_agree(runs["flashinfer"], runs["torch"], ref, margin)
    # again: the long prompt's full blocks are now cached, so its prefill is a chunk after a prefix
    again = {b: e.generate([prompts[5], prompts[6]], greedy(24)) for b, e in engines.items()}
    assert [s.num_cached_tokens for s in again["flashinfer"]] == [96, 240]
    assert_greedy_agree(again["flashinfer"], again["torch"], ref, margin)


def test_cuda_default_backend_is_flashinfer(small_model, prompts):
    assert default_backend(CUDA, 64, torch.bfloat16) == "flashinfer"
    assert default_backend(CUDA, 16, torch.bfloat16) == "torch"
    assert default_backend(torch.device("cpu"), 64, torch.float32) == "torch"
    engine = Engine(EngineConfig(small_model, device="cuda", num_kv_blocks=128))
    assert engine.attention.name == "flashinfer"
    assert engine.dtype == torch.bfloat16
    (seq,) = engine.generate([prompts[3]], greedy(4))
    assert len(seq.output_token_ids) == 4


def test_cuda_default_serves_a_model_flashinfer_cannot(tiny_model):
    # head_dim 16: the default choice must fall back to the torch backend rather than fail
    engine = Engine(EngineConfig(tiny_model, device="cuda", num_kv_blocks=128))
    assert engine.attention.name == "torch"
    (seq,) = engine.generate([[5, 6, 7, 8]], greedy(4))
    assert len(seq.output_token_ids) == 4


# -- CUDA graphs -----------------------------------------------------------------


def test_cuda_graph_decode_agrees_with_eager_decode_as_the_batch_shrinks(small_model, prompts):
    # each sequence stops at its own length: decode batches of 7, 6, ..., 1 replay the graphs of
    # sizes 8, 4, 2 and 1, most of them with pad rows
    lengths = [4 + 3 * i for i in range(len(prompts))]
    ref = make_engine(small_model, "float32", "torch")
    ref_logits, _ = step_logits(ref, prompts, 1)
    same_logits, _ = step_logits(make_engine(small_model, "bfloat16", "torch"), prompts, 1)
    margin = 2 * (same_logits[0] - ref_logits[0]).abs().max().item()
    eager = make_engine(small_model, "bfloat16", "flashinfer")
    graphed = make_engine(small_model, "bfloat16", "flashinfer", cuda_graphs=True)
    assert eager.runner.graphs is None and graphed.runner.graphs is not None

    # the first decode step: the same logits as the eager step, up to this dtype's noise
    (eager_logits, _), (graph_logits, _) = step_logits(eager, prompts, 2), step_logits(graphed, prompts, 2)
    assert graphed.runner.graphs.replays == 1 and set(graphed.runner.graphs.graphs) == {8}
    assert (graph_logits[1] - eager_logits[1]).abs().max().item() <= margin

    runs = {name: e.generate(prompts, [greedy(n) for n in lengths]) for name, e in
            (("eager", eager), ("graphed", graphed))}
    assert [len(s.output_token_ids) for s in runs["graphed"]] == lengths
    assert set(graphed.runner.graphs.graphs) == {8, 4, 2, 1}
    assert graphed.runner.graphs.replays >= max(lengths)
    assert_greedy_agree(runs["graphed"], runs["eager"], ref, margin)
    # the cache the graphs wrote serves a prefix hit like the eager one
    again = {name: e.generate([prompts[5]], greedy(8)) for name, e in (("eager", eager), ("graphed", graphed))}
    assert again["graphed"][0].num_cached_tokens == again["eager"][0].num_cached_tokens > 0
    assert_greedy_agree(again["graphed"], again["eager"], ref, margin)


def test_cuda_graph_decode_over_a_shared_prefix_longer_than_the_page_buffer(small_model):
    # eight sequences on one cached 1,100-token prefix list its 68 blocks eight times: more pages
    # than the graph wrapper's first buffer (pool + batch = 520), so it grows and is captured again
    rng = random.Random(11)
    prefix = [rng.randrange(4096) for _ in range(1100)]
    prompts = [prefix + [rng.randrange(4096) for _ in range(5)] for _ in range(8)]
    ref = make_engine(small_model, "float32", "torch")
    margin = 2 * (step_logits(make_engine(small_model, "bfloat16", "torch"), prompts[:1], 1)[0][0]
                  - step_logits(ref, prompts[:1], 1)[0][0]).abs().max().item()
    engines = {"eager": make_engine(small_model, "bfloat16", "flashinfer"),
               "graphed": make_engine(small_model, "bfloat16", "flashinfer", cuda_graphs=True)}
    runs = {}
    for name, e in engines.items():
        e.generate([[rng.randrange(4096) for _ in range(9)] for _ in range(8)], greedy(3))  # short: 8 pages
        e.generate([prefix + [1]], greedy(2))  # caches the prefix
        runs[name] = e.generate(prompts, greedy(6))
        assert [s.num_cached_tokens for s in runs[name]] == [1088] * 8
    graphs = engines["graphed"].runner.graphs
    assert graphs.captures == 3  # batch 8 (short prompts), batch 1 (the prefix), batch 8 again
    assert engines["graphed"].attention._graph_wrappers[8][1] >= 8 * 70
    assert_greedy_agree(runs["graphed"], runs["eager"], ref, margin)
