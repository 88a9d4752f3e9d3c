"""Shared fixtures: the tiny and small models, HF reference checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# the shared checks assert too: report their failures as pytest does a test's own asserts
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.checkpoints import HF_FAMILIES, make_hf_checkpoint  # noqa: E402
from tests.helpers.order import known_durations, sort_items  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist runs the suite in a few processes (pyproject's addopts): they share the cores
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


def pytest_collection_modifyitems(config, items) -> None:
    # the longest modules first (tests/module_durations.json): under xdist the short ones fill the end
    sort_items(items, known_durations())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """The ``small`` checkpoint (head_dim 64, which FlashInfer serves; the tiny one's 16 it does not)."""
    from engine.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "small", size="small")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {f: make_hf_checkpoint(f, root / f) for f in HF_FAMILIES}
    out["llama_tied"] = make_hf_checkpoint("llama", root / "llama_tied", tie=True)
    return out


@pytest.fixture(scope="session")
def deepseek_models(tmp_path_factory) -> dict[str, Path]:
    """``mesh model tiny --size deepseek`` (q_lora_rank set), ``deepseek-yarn`` (q_lora_rank null,
    YaRN) and ``deepseek --fp8``: tiny DeepSeek-V3 checkpoints made with transformers."""
    from engine.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("deepseek")
    return {"deepseek": write_tiny_model(root / "deepseek", size="deepseek"),
            "deepseek-yarn": write_tiny_model(root / "deepseek-yarn", size="deepseek-yarn"),
            "deepseek-fp8": write_tiny_model(root / "deepseek-fp8", size="deepseek", fp8=True)}
