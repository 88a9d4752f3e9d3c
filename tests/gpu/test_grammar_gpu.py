"""Constrained decoding on CUDA: the mask applied on the device equals the CPU one, and a
constrained engine run on the GPU validates. Skips cleanly without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.config import EngineConfig
from engine.constraints import Constraint
from engine.constraints.masks import apply_bitmask
from engine.engine import Engine
from engine.sampling import SamplingParams
from mesh.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu


def test_the_device_mask_equals_the_cpu_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 151_936, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4748), dtype=torch.int32, generator=g)
    rows = [0, 2, 3, 6, 7]
    cpu = logits.clone()
    apply_bitmask(cpu, bitmask, rows)
    gpu = logits.cuda()
    apply_bitmask(gpu, bitmask.pin_memory(), rows)
    assert torch.equal(gpu.cpu(), cpu)


def test_a_constrained_run_on_the_gpu_validates(tiny_model):
    tok = Tokenizer(tiny_model)
    engine = Engine(EngineConfig(tiny_model, device="cuda", dtype="float32", num_kv_blocks=256,
                                 attention_backend="torch"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}
    prompt = tok.encode_chat([{"role": "user", "content": "JSON please"}])
    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=40, constraint=Constraint.json_schema(schema),
                                                          **params))
        value = json.loads(tok.decode(seq.output_token_ids))
        assert set(value) == {"ok", "n"} and seq.status.finish_reason == "stop"
    engine.close()
