"""engine/pooling.py: the embed worker's vectors are transformers' pooled, normalised hidden states
(``AutoModel(...).last_hidden_state`` of the same directory), many prompts in one forward equal
one forward each, and a model's pooling and matryoshka sizes come from its directory."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine.config import EngineConfig
from engine.pooling import Embedder, PoolingConfig, truncate
from mesh.errors import ModelError, RequestError

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], list(range(100, 160)), [3], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()


def reference(hf_model, prompt: list[int], method: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model(torch.tensor([prompt])).last_hidden_state[0]
    return F.normalize(hidden[-1] if method == "last" else hidden.mean(0), dim=-1)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_vectors_are_transformers_pooled_hidden_states(tiny_model, hf_model, method):
    embedder = Embedder(EngineConfig(model=tiny_model, device="cpu"), PoolingConfig(method))
    batched = embedder.embed(PROMPTS)
    assert batched.shape == (len(PROMPTS), 64) and batched.dtype == torch.float32
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(batched[i], reference(hf_model, prompt, method), atol=1e-4, rtol=0)
        one = embedder.embed([prompt])[0]  # alone: no padding, plain causal attention
        torch.testing.assert_close(batched[i], one, atol=1e-5, rtol=0)
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(PROMPTS)), atol=1e-5)
    same_length = [PROMPTS[0], PROMPTS[0][::-1], [7] * 6]  # no padding: the uniform path
    torch.testing.assert_close(embedder.embed(same_length), torch.cat([embedder.embed([p]) for p in same_length]),
                               atol=1e-5, rtol=0)


def test_a_token_budget_splits_the_forward_and_keeps_the_order(tiny_model):
    whole = Embedder(EngineConfig(model=tiny_model, device="cpu"), PoolingConfig("mean"))
    small = Embedder(EngineConfig(model=tiny_model, device="cpu", max_num_batched_tokens=16), PoolingConfig("mean"))
    assert len(small._groups(sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i])), PROMPTS)) >= 3
    torch.testing.assert_close(small.embed(PROMPTS), whole.embed(PROMPTS), atol=1e-5, rtol=0)


def test_bad_inputs_are_request_errors(tiny_model):
    embedder = Embedder(EngineConfig(model=tiny_model, device="cpu", max_model_len=32), PoolingConfig())
    for prompts in ([[]], [list(range(1, 40))], [[1, 5000]]):
        with pytest.raises(RequestError):
            embedder.embed(prompts)
    with pytest.raises(RequestError, match="matryoshka"):
        embedder.embed([[1, 2]], dimensions=8)
    assert embedder.embed([[1, 2]], dimensions=64).shape == (1, 64)  # its own size: as it is


def _model_copy(tiny_model, tmp_path, config: dict | None = None, pooling: dict | None = None):
    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
    if pooling is not None:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return path


def test_pooling_comes_from_sentence_transformers_files_else_the_flag(tiny_model, tmp_path):
    assert PoolingConfig.from_dir(tiny_model, "mean").method == "mean"  # no modules.json: the flag
    path = _model_copy(tiny_model, tmp_path, pooling={"pooling_mode_lasttoken": True,
                                                      "pooling_mode_mean_tokens": False})
    assert PoolingConfig.from_dir(path, "mean").method == "last"  # the files win
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_dir(path)


def test_matryoshka_truncates_and_renormalises(tiny_model, tmp_path):
    path = _model_copy(tiny_model, tmp_path, config={"matryoshka_dimensions": [16, 32]})
    pooling = PoolingConfig.from_dir(path)
    assert pooling.matryoshka and pooling.dimensions == (16, 32)
    embedder = Embedder(EngineConfig(model=path, device="cpu"), pooling)
    full = embedder.embed(PROMPTS[:2])
    cut = embedder.embed(PROMPTS[:2], dimensions=16)
    torch.testing.assert_close(cut, F.normalize(full[:, :16], dim=-1))
    torch.testing.assert_close(truncate(full, 16), cut)
    with pytest.raises(RequestError, match="16, 32"):
        embedder.embed(PROMPTS[:1], dimensions=8)
    assert PoolingConfig.from_dir(_model_copy(tiny_model, tmp_path / "any", config={"is_matryoshka": True})).matryoshka


async def test_requests_queued_during_a_forward_share_the_next_one(tiny_model, tmp_path):
    from decode.embed import EmbedBatcher

    path = _model_copy(tiny_model, tmp_path, config={"is_matryoshka": True})
    embedder = Embedder(EngineConfig(model=path, device="cpu"), PoolingConfig.from_dir(path))
    forwards = []
    real = embedder.embed
    embedder.embed = lambda prompts, dimensions=0: forwards.append(len(prompts)) or real(prompts, dimensions)
    batcher = EmbedBatcher(embedder, max_tokens=10_000)
    batcher.start()
    try:
        asks = [(PROMPTS[i:i + 2], 16 if i % 2 else 0) for i in range(len(PROMPTS))]
        got = await asyncio.gather(*(batcher.embed(p, d) for p, d in asks))
    finally:
        await batcher.stop()
    assert len(forwards) < len(asks) and sum(forwards) == sum(len(p) for p, _ in asks)
    for (prompts, dims), vectors in zip(asks, got, strict=True):
        torch.testing.assert_close(vectors, real(prompts, dims), atol=1e-5, rtol=0)
