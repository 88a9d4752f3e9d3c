"""Each FlashInfer fused kernel (``--fused-kernels``) against the plain PyTorch path, on CUDA.

Op level: the same inputs through ``engine.kernels``' plain and fused implementations,
compared to a float32 reference with the plain path's own bf16 error as the yardstick. Sampling:
top-k 1 is the argmax, no token ever comes from outside the top-k / top-p set, and the draws
follow the filtered distribution. Engine level: the ``small`` checkpoint with every fused
kernel gives the plain engine's greedy tokens (up to float32 near ties).

Skips cleanly (collected, reported as skipped) without CUDA or flashinfer.
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kernels import (
    FUSED_KERNELS,
    FlashInferRope,
    Kernels,
    TorchRope,
    flashinfer_add_rmsnorm,
    flashinfer_silu_and_mul,
    flashinfer_top_k_top_p,
    torch_add_rmsnorm,
    torch_silu_and_mul,
)
from engine.model import Rotary
from engine.sampling import SamplingParams
from tests.helpers.greedy_checks import assert_greedy_agree, dtype_margin, greedy

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=CUDA).to(dtype)


def no_worse_than_plain(fused: torch.Tensor, plain: torch.Tensor, ref: torch.Tensor, slack: float = 1e-2):
    """The fused result is as close to the float32 reference as the plain bf16 one (plus slack)."""
    err_f = (fused.float() - ref).abs().max().item()
    err_p = (plain.float() - ref).abs().max().item()
    assert err_f <= 2 * err_p + slack, (err_f, err_p)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rmsnorm(rows):
    x, residual, w = randn(rows, 4096, seed=1), randn(rows, 4096, seed=2), 1 + 0.1 * randn(4096, seed=3)
    ref_normed, ref_residual = torch_add_rmsnorm(x.float(), residual.float(), w.float(), 1e-5)
    plain_normed, plain_residual = torch_add_rmsnorm(x, residual, w, 1e-5)
    fused_normed, fused_residual = flashinfer_add_rmsnorm(x.clone(), residual.clone(), w, 1e-5)
    assert fused_normed.dtype == torch.bfloat16 and fused_residual.shape == (rows, 4096)
    no_worse_than_plain(fused_residual, plain_residual, ref_residual)
    no_worse_than_plain(fused_normed, plain_normed, ref_normed)


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(rows):
    x = randn(rows, 2 * 14336, seed=4)
    ref, plain, fused = torch_silu_and_mul(x.float()), torch_silu_and_mul(x), flashinfer_silu_and_mul(x)
    assert fused.shape == (rows, 14336)
    no_worse_than_plain(fused, plain, ref)


@pytest.mark.parametrize("scaling", ["default", "llama3"])
def test_rope_in_place_on_the_qkv_output(tmp_path, scaling):
    # the Llama-3-8B head layout, q and k as views of one fused projection output
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128,
           "max_position_embeddings": 8192, "rope_theta": 500000.0}
    if scaling == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    rotary = Rotary(ModelConfig.from_dir(tmp_path), 8192).to(CUDA)
    positions = torch.tensor([0, 1, 5, 700, 4095, 8191, 3, 2], device=CUDA)
    qkv = randn(len(positions), 32 + 16, 128, seed=5)
    ref_q, ref_k = TorchRope(rotary.cos, rotary.sin, positions, torch.float32).rotate_fused(qkv[:, :40].float(), 32)
    plain_q, plain_k = TorchRope(rotary.cos, rotary.sin, positions, torch.bfloat16).rotate_fused(qkv[:, :40], 32)
    fused_qkv = qkv.clone()
    fused_q, fused_k = FlashInferRope(rotary.cos_sin_cache(), positions).rotate_fused(fused_qkv[:, :40], 32)
    assert fused_q.data_ptr() == fused_qkv.data_ptr()  # in place: no copy of q or k
    no_worse_than_plain(fused_q, plain_q, ref_q)
    no_worse_than_plain(fused_k, plain_k, ref_k)
    assert torch.equal(fused_qkv[:, 40:], qkv[:, 40:])  # v untouched


def test_top_k_1_is_the_argmax():
    logits = randn(16, 1000, dtype=torch.float32, seed=6)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    k = torch.ones(16, dtype=torch.int32, device=CUDA)
    p = torch.ones(16, device=CUDA)
    assert torch.equal(flashinfer_top_k_top_p(logits, k, p, gen), logits.argmax(-1))


def test_sampling_stays_in_the_filtered_set_and_follows_its_distribution():
    vocab, draws = 12, 40000
    base = torch.linspace(2.0, -2.0, vocab, device=CUDA)  # token 0 likeliest
    logits = base.repeat(draws, 1)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    k = torch.full((draws,), 6, dtype=torch.int32, device=CUDA)
    p = torch.full((draws,), 0.8, device=CUDA)
    tokens = flashinfer_top_k_top_p(logits, k, p, gen)
    probs = torch.softmax(base, -1)
    kept = probs[:6] / probs[:6].sum()  # top-k 6, then top-p 0.8 over those
    cut = int((torch.cumsum(kept, 0) - kept < 0.8).sum())
    allowed = kept[:cut] / kept[:cut].sum()
    counts = torch.bincount(tokens, minlength=vocab).float() / draws
    assert counts[cut:].sum() == 0, "a token outside top-k/top-p"
    assert torch.allclose(counts[:cut], allowed, atol=0.015), (counts[:cut], allowed)


# -- engine level ------------------------------------------------------------------------------


def make(model, dtype="bfloat16", **kw) -> Engine:
    return Engine(EngineConfig(model, device="cuda", dtype=dtype, num_kv_blocks=512, **kw))


@pytest.mark.parametrize("fused", [*[(k,) for k in FUSED_KERNELS if k != "sampling"], FUSED_KERNELS],
                         ids=lambda f: "+".join(f))
def test_engine_greedy_with_fused_kernels_agrees_with_the_plain_engine(small_model, fused):
    rng = random.Random(3)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (3, 40, 130, 9)]
    ref = make(small_model, "float32", attention_backend="torch")
    margin = dtype_margin(ref, make(small_model, attention_backend="torch"), prompts)
    plain, fast = make(small_model), make(small_model, fused_kernels=fused)
    assert fast.model.kernels.names == frozenset(fused) and not plain.model.kernels.names
    runs = {name: e.generate(prompts, greedy(16)) for name, e in (("plain", plain), ("fused", fast))}
    assert_greedy_agree(runs["fused"], runs["plain"], ref, margin)


def test_engine_samples_with_the_fused_sampler(small_model):
    engine = make(small_model, fused_kernels=("sampling",))
    assert engine.sampler.kernels.top_k_top_p is not None
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True)
    seqs = engine.generate([[5, 6, 7], [8, 9]], params)
    assert all(len(s.output_token_ids) == 8 for s in seqs)
    # a seeded request is drawn by the PyTorch path, so it repeats exactly
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    a, b = engine.generate([[5, 6, 7]], seeded), engine.generate([[5, 6, 7]], seeded)
    assert a[0].output_token_ids == b[0].output_token_ids


def test_every_kernel_can_be_selected():
    k = Kernels.select(FUSED_KERNELS)
    assert k.names == frozenset(FUSED_KERNELS) and k.top_k_top_p is flashinfer_top_k_top_p
