"""The mocker takes the engine's scheduling flags as a model worker does (issue 33: it ignored
``--max-num-batched-tokens`` and prefilled up to 8192 tokens in one step, a 0.5 s stall of every
stream it decoded)."""

from __future__ import annotations

from cli.main import build_parser
from mocker.engine import MockConfig


def mock_config(*flags: str) -> MockConfig:
    return MockConfig.from_args(build_parser().parse_args(["worker", "mock", *flags]))


def test_mock_worker_takes_the_prefill_budget_flag():
    assert mock_config("--max-num-batched-tokens", "512").max_num_batched_tokens == 512
    assert mock_config("--max-num-seqs", "64").max_num_seqs == 64


def test_mock_worker_default_prefill_budget_is_a_model_workers():
    assert mock_config().max_num_batched_tokens == 2048
    assert mock_config().build().kv_costs is not None  # builds with it
