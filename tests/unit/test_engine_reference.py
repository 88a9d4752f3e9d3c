"""Our engine against Hugging Face transformers, the numerical reference."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.helpers.references import (
    assert_logits_match_transformers,
    hf_greedy,
    hf_model,
    prompts_of,
)

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_prefill_and_each_decode_step(hf_checkpoints, family):
    assert_logits_match_transformers(hf_checkpoints[family], family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_matches_transformers_generate(hf_checkpoints, family):
    path = hf_checkpoints[family]
    ref = hf_model(path)
    prompts = prompts_of([3, 17, 40, 64, 9], ref.config.vocab_size, seed=1)
    expected = [hf_greedy(ref, p, 24) for p in prompts]
    engine = Engine(EngineConfig(path, num_kv_blocks=256))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert [s.output_token_ids for s in seqs] == expected


@pytest.fixture(scope="module")
def llama_reference(hf_checkpoints):
    path = hf_checkpoints["llama"]
    ref = hf_model(path)
    prompts = prompts_of([3, 17, 40, 64, 9, 100], ref.config.vocab_size, seed=2)
    return path, prompts, [hf_greedy(ref, p, 32) for p in prompts]


def test_chunked_prefill_is_token_identical(llama_reference):
    path, prompts, expected = llama_reference
    # a 16-token budget splits every long prompt across several steps, mixed with decodes
    engine = Engine(EngineConfig(path, num_kv_blocks=256, max_num_batched_tokens=16))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.num_steps > 32 + 100 // 16  # the 100-token prompt took several chunks


def test_preemption_under_a_small_pool_is_token_identical(llama_reference):
    path, prompts, expected = llama_reference
    # 40 blocks of 4 tokens cannot hold all six sequences (~400 tokens) at once
    engine = Engine(EngineConfig(path, num_kv_blocks=40, block_size=4))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.pool.num_used == 0  # every block came back


def test_prefix_cache_hit_is_token_identical(llama_reference):
    path, prompts, expected = llama_reference
    engine = Engine(EngineConfig(path, num_kv_blocks=256, block_size=8))
    long_prompt = prompts[5]
    (first,) = engine.generate([long_prompt], SamplingParams(max_tokens=32, temperature=0.0))
    assert first.num_cached_tokens == 0
    (second,) = engine.generate([long_prompt], SamplingParams(max_tokens=32, temperature=0.0))
    assert second.num_cached_tokens == 96  # (100 - 1) // 8 full blocks
    assert first.output_token_ids == second.output_token_ids == expected[5]
    # a prompt sharing a prefix reuses the shared full blocks
    shared = [*long_prompt[:50], 7, 8, 9]
    (third,) = engine.generate([shared], SamplingParams(max_tokens=8, temperature=0.0))
    assert third.num_cached_tokens == 48


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_linears_run_packed_and_agree_with_the_plain_path(hf_checkpoints, dtype, monkeypatch):
    """The logits test above runs the packed path; this one checks that it is the packed path, and
    that packing changes nothing beyond rounding (also in bfloat16, which transformers is not run in)."""
    import engine.loader as loader
    from engine.model import PackedLinear

    path = hf_checkpoints["qwen2"]  # q/k/v biases: the packed path takes them too
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU (no AVX-512 BF16/AVX-NE-CONVERT): "
                    "the engine serves bfloat16 through the plain path here")
    prompts = prompts_of([7, 21], 256)

    def logits(engine):
        engine.runner.capture_logits = True
        engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
        return engine.runner.last_logits

    packed = Engine(EngineConfig(path, num_kv_blocks=64, dtype=dtype))
    linears = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * packed.model_config.num_layers + 1  # qkv, o, gate_up, down; lm_head
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    monkeypatch.setattr(loader, "pack_cpu_linears", lambda model: 0)
    plain = Engine(EngineConfig(path, num_kv_blocks=64, dtype=dtype))
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    tol = 1e-4 if dtype == "float32" else 5e-2  # fp32: the bound the logits test holds us to
    torch.testing.assert_close(logits(packed), logits(plain), atol=tol, rtol=tol)
