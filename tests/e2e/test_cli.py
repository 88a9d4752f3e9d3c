"""The ``mesh`` command line as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.tokenizer import Tokenizer


def mesh(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_matches_the_engine(tiny_model):
    r = mesh("generate", "--model", str(tiny_model), "--json", "--max-tokens", "12",
             "Hello world", "The mesh routes each request")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 2
    tok = Tokenizer(tiny_model)
    engine = Engine(EngineConfig(tiny_model, num_kv_blocks=256))
    for line in lines:
        assert line["prompt_token_ids"] == tok.encode(line["prompt"])
        (seq,) = engine.generate([line["prompt_token_ids"]], SamplingParams(max_tokens=12, temperature=0.0))
        assert line["token_ids"] == seq.output_token_ids
        assert line["text"] == tok.decode(seq.output_token_ids)
        assert line["finish_reason"] == "length"


def test_model_tiny_is_deterministic(tmp_path, tiny_model):
    r = mesh("model", "tiny", str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (tmp_path / "t" / name).read_bytes() == (tiny_model / name).read_bytes()
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 8192


@pytest.mark.parametrize("case", ["missing", "unsupported", "malformed", "too_long", "no_weights"])
def test_bad_input_is_one_line_and_nonzero(tmp_path, tiny_model, case):
    model = tmp_path / "m"
    prompt = "hi"
    if case == "missing":
        expect = "does not exist"
    elif case == "unsupported":
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        expect = "unsupported architecture GPT2LMHeadModel"
    elif case == "malformed":
        model.mkdir()
        (model / "config.json").write_text("{not json")
        expect = "not valid JSON"
    elif case == "no_weights":
        model.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (model / f).write_bytes((tiny_model / f).read_bytes())
        expect = "no *.safetensors"
    else:
        model = tiny_model
        prompt = "word " * 300
        expect = "this model's context is 64 tokens"
    args = ["generate", "--model", str(model), prompt]
    if case == "too_long":
        args[1:1] = ["--device-kv-blocks", "4"]
    r = mesh(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("mesh: error:") and expect in lines[0], lines[0]


@pytest.mark.parametrize("content", [None, "not hex", "00" * 16])
def test_a_bad_hash_key_file_is_one_line_and_nonzero(tmp_path, content):
    key = tmp_path / "hash.key"
    if content is not None:
        key.write_text(content)
    r = mesh("worker", "mock", "--nats", "nats://127.0.0.1:1", "--hash-key-file", str(key))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mesh: error:") and "hash-key" in lines[0], r.stderr
