"""FlashInfer over an FP8 KV cache (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) against the torch
backend over the same FP8 cache, on CUDA: both read the same bytes (the torch backend
dequantizes the pages it gathers, FlashInfer's kernels as they load them), so their outputs
agree to the half-precision queries' rounding, and both write the same bytes. Then an engine
on ``small`` with an FP8 cache on FlashInfer, whose pool holds half a bf16 pool's bytes.

Skips cleanly (collected, reported as skipped) without CUDA or flashinfer.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from kvstore.cache import KVCache, KVCacheSpec
from kvstore.kv_dtype import to_kv_dtype
from tests.gpu.test_flashinfer import LAYOUTS, make_step, run_step

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("backend", ["flashinfer", "flashinfer-ragged"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fp8", list(FP8))
def test_flashinfer_over_an_fp8_cache_matches_the_torch_backend(backend, layout, fp8):
    spec = KVCacheSpec(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=2, head_dim=64, dtype=FP8[fp8])
    batch = make_step(LAYOUTS[layout], spec.block_size, spec.num_blocks, seed=0)
    g = torch.Generator(device=CUDA).manual_seed(0)
    earlier = to_kv_dtype(torch.randn(spec.shape, generator=g, device=CUDA), spec.dtype)
    T = batch.num_tokens
    qkv = [tuple(torch.randn(T, h, 64, generator=g, device=CUDA).to(torch.bfloat16) for h in (8, 2, 2))
           for _ in range(spec.num_layers)]
    out = {}
    for name in (backend, "torch"):
        kv = KVCache(spec, CUDA)
        kv.tensor.copy_(earlier)
        out[name] = (kv, run_step(name, kv, batch, qkv))
    (kv_f, out_f), (kv_t, out_t) = out[backend], out["torch"]
    for layer in range(spec.num_layers):
        assert out_f[layer].dtype == torch.bfloat16
        torch.testing.assert_close(out_f[layer].float(), out_t[layer].float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(kv_f.tensor.view(torch.uint8), kv_t.tensor.view(torch.uint8))


def test_an_engine_with_an_fp8_cache_on_flashinfer(small_model):
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(40 + 13 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        engine = Engine(EngineConfig(small_model, device="cuda", dtype="bfloat16", kv_cache_dtype=kv_dtype,
                                     attention_backend="flashinfer", num_kv_blocks=256))
        runs[kv_dtype] = ([s.output_token_ids for s in engine.generate(prompts, params)],
                          engine.kv_cache.tensor.nbytes, engine.kv_spec.dtype)
        engine.close()
    (bf16, bf16_bytes, _), (fp8, fp8_bytes, dtype) = runs["auto"], runs["fp8_e4m3"]
    assert dtype == torch.float8_e4m3fn and fp8_bytes * 2 == bf16_bytes
    same = sum(a == b for x, y in zip(fp8, bf16, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.25 * 16 * len(prompts), (fp8, bf16)  # random weights: near ties; broken: ~0


def test_torch_and_flashinfer_engines_read_an_fp8_pool_alike(small_model):
    """The same FP8 pool bytes through either backend: the torch backend's engine as reference."""
    prompts = [[(11 * i + j) % 4000 + 3 for j in range(60)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for backend in ("torch", "flashinfer"):
        engine = Engine(EngineConfig(small_model, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                                     attention_backend=backend, num_kv_blocks=128))
        outs.append([s.output_token_ids for s in engine.generate(prompts, params)])
        engine.close()
    same = sum(a == b for x, y in zip(*outs, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.5 * 8 * len(prompts), outs
