"""Block-scaled FP8 GEMMs (``engine.fp8_linear``) on CUDA: ``scaled_mm`` against the dequantized
matmul, and the ``small`` checkpoint's FP8 version served with its weights resident in FP8.

On compute capability 9.x (H100/H200) with torch's blockwise ``_scaled_mm``; elsewhere the
engine dequantizes at load, and these tests skip. Skips cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import engine.loader as loader
from engine.config import EngineConfig
from engine.engine import Engine
from engine.fp8 import dequantize, quantize
from engine.fp8_linear import Fp8Linear, ScaledMmGemm, probe, resident_gemm
from engine.tiny import write_tiny_model
from tests.helpers.greedy_checks import assert_greedy_agree, greedy, step_logits

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
if torch.cuda.get_device_capability(CUDA)[0] != 9:
    pytest.skip("blockwise FP8 GEMMs are checked on compute capability 9.x", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 7, 256])
def test_scaled_mm_matches_the_dequantized_matmul(dtype, m):
    g = torch.Generator().manual_seed(m)
    w, scale = quantize(torch.randn(768, 1024, generator=g), (128, 128))
    x = torch.randn(m, 1024, generator=g).to(CUDA, dtype)
    w, scale = w.to(CUDA), scale.to(CUDA)
    want = torch.nn.functional.linear(x.float(), dequantize(w, scale, (128, 128)))
    got = ScaledMmGemm()(x, w, scale, (128, 128))
    assert got.shape == (m, 768) and got.dtype == dtype
    assert ((got.float() - want).norm() / want.norm()).item() < 0.05  # FP8 activations: ~2^-4 per element
    assert probe(ScaledMmGemm(), CUDA, dtype)


def test_the_engine_keeps_fp8_weights_resident_and_agrees_with_dequantized(tmp_path, monkeypatch):
    assert isinstance(resident_gemm(CUDA, (128, 128), torch.bfloat16), ScaledMmGemm)
    assert resident_gemm(CUDA, (16, 16), torch.bfloat16) is None  # scaled_mm's blocks are 128x128
    path = write_tiny_model(tmp_path / "small-fp8", size="small", fp8=True)
    prompts = [[5, 6, 7, 8, 9] * 4, [100, 200, 300]]
    resident = Engine(EngineConfig(path, device="cuda", dtype="bfloat16", num_kv_blocks=256))
    layers = [m for m in resident.model.modules() if isinstance(m, Fp8Linear)]
    # o, gate_up and down of every layer (640, 1792: whole 128-blocks); not qkv, whose k and v parts
    # (5 heads x 64 = 320 rows) end inside a block
    assert len(layers) == 3 * 10
    monkeypatch.setattr(loader, "resident_gemm", lambda *args: None)
    dequantized = Engine(EngineConfig(path, device="cuda", dtype="bfloat16", num_kv_blocks=256))
    assert not any(isinstance(m, Fp8Linear) for m in dequantized.model.modules())
    a, _ = step_logits(resident, prompts, 1)
    b, _ = step_logits(dequantized, prompts, 1)
    diff = (a[0].float() - b[0].float()).abs().max().item()
    assert diff < 0.1 * b[0].float().abs().max().item()  # only the activations' FP8 rounding differs
    got = resident.generate(prompts, greedy(16))
    want = dequantized.generate(prompts, greedy(16))
    assert_greedy_agree(got, want, dequantized, margin=2 * diff)
