"""FlashInfer's MLA kernels (the ``flashinfer`` latent backend) against the torch latent backend,
on CUDA, at DeepSeek-V3's dimensions (latent 512, rope key 64, 16 heads per rank here).

One step of random absorbed queries and latents over a latent cache holding random earlier
context (decodes, chunks after a cached prefix, fresh prefills), every output row checked
against the torch backend run in float32 on the same cache, and the written pages checked to be
exactly the torch backend's. Skips cleanly without CUDA or flashinfer.
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
from kvstore.cache import KVCache, KVCacheSpec

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
C, R, HEADS = 512, 64, 16
SCALE = (128 + 64) ** -0.5  # DeepSeek's nope + rope query dims before absorption
LAYOUTS = {
    "mixed": [(37, 1), (16, 1), (0, 1), (32, 20), (7, 9), (0, 50), (700, 30)],
    "decode": [(37, 1), (16, 1), (0, 1), (100, 1), (1500, 1)],
    "prefill": [(0, 50), (32, 20), (7, 9), (0, 2)],
}
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_step(layout, block_size: int, num_blocks: int, seed: int) -> AttentionBatch:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    qlens, ctxs, tables, slots = [], [], [], []
    for cached, new in layout:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size) + 1)]
        qlens.append(new)
        ctxs.append(ctx)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
    return AttentionBatch(qlens, ctxs, tables, torch.tensor(slots, dtype=torch.long, device=CUDA))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flashinfer_mla_matches_the_torch_latent_backend(layout, dtype):
    spec = KVCacheSpec(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=1, head_dim=C + R, dtype=dtype,
                       num_planes=1)
    batch = make_step(LAYOUTS[layout], spec.block_size, spec.num_blocks, seed=0)
    g = torch.Generator(device=CUDA).manual_seed(0)
    earlier = torch.randn(spec.shape, generator=g, device=CUDA) * 0.5
    T = batch.num_tokens
    steps = [(torch.randn(T, HEADS, C + R, generator=g, device=CUDA) * 0.1, torch.randn(T, C + R, generator=g, device=CUDA))
             for _ in range(spec.num_layers)]
    outs, caches = {}, {}
    for name, cache_dtype in [("flashinfer", dtype), ("torch", dtype), ("reference", torch.float32)]:
        kv = KVCache(replace(spec, dtype=cache_dtype), CUDA)
        kv.tensor.copy_(earlier.to(cache_dtype))
        backend = create_backend("torch" if name == "reference" else name, kv, SCALE, C)
        backend.plan(batch)
        outs[name] = [backend.forward(i, q.to(cache_dtype), lat.to(cache_dtype)) for i, (q, lat) in enumerate(steps)]
        caches[name] = kv
    tol = TOL[dtype]
    for layer in range(spec.num_layers):
        got = outs["flashinfer"][layer]
        assert got.shape == (T, HEADS, C) and got.dtype == dtype
        torch.testing.assert_close(got.float(), outs["reference"][layer], atol=tol, rtol=tol)
    assert torch.equal(caches["flashinfer"].tensor, caches["torch"].tensor)


def test_the_default_latent_backend_is_flashinfer_for_deepseeks_dims_only():
    assert default_backend(CUDA, 64, torch.bfloat16, latent=(C, R)) == "flashinfer"
    assert default_backend(CUDA, 16, torch.bfloat16, latent=(32, 16)) == "torch"  # the tiny checkpoint's
    assert default_backend(CUDA, 64, torch.float32, latent=(C, R)) == "torch"


def test_unsupported_latent_dims_are_refused_with_the_reason():
    spec = KVCacheSpec(1, 4, 16, 1, 48, torch.bfloat16, num_planes=1)
    with pytest.raises(ValueError, match="MLA kernels serve"):
        create_backend("flashinfer", KVCache(spec, CUDA), 0.2, 32)
