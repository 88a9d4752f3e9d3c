"""FP8 weights in DeepSeek's block-scaled format (e4m3 + a float32 ``weight_scale_inv`` per block):
the block arithmetic, checkpoints of DeepSeek-V3 and the Llama/Qwen families against transformers
run on the dequantized weights, and the one-line errors for broken FP8 checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loader as loader
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.fp8 import FP8_DTYPE, Fp8Scheme, dequantize, quantize
from engine.fp8_linear import DequantGemm, Fp8Linear
from engine.sampling import SamplingParams
from engine.tiny import quantize_checkpoint
from mesh.errors import ModelError
from tests.helpers.references import hf_greedy, hf_model, prompts_of

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def dequantized_by_loops(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: every block times its own scale, one block at a time (edge blocks partial)."""
    out = q.float().clone()
    bn, bk = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale_inv[i, j]
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src``'s FP8 checkpoint with every FP8 weight dequantized (by the loops above) to float32, the
    scales dropped and the quantization_config gone: what transformers runs as the reference."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    plain = {name: (dequantized_by_loops(t, tensors[name + "_scale_inv"], block) if t.dtype == FP8_DTYPE else t)
             for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_file(plain, str(dst / "model.safetensors"))
    return dst


# -- the format -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 64), (48, 64), (100, 37), (5, 200)])
def test_block_quantization_round_trips_with_partial_edge_blocks(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, shape[1])
    q, scale_inv = quantize(w, (32, 32))
    assert q.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    back = dequantize(q, scale_inv, (32, 32))
    assert torch.equal(back, dequantized_by_loops(q, scale_inv, (32, 32)))
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, plus a block's smallest step
    assert ((back - w).abs() <= w.abs() / 16 + scale_inv.max() / 64).all()


def test_the_quantization_config_is_read_and_checked():
    good = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert Fp8Scheme.from_config({"quantization_config": good}).block == (128, 128)
    assert Fp8Scheme.from_config({}) is None
    for change, match in [({"quant_method": "awq"}, "unsupported quantization 'awq'"),
                          ({"activation_scheme": "static"}, "activation_scheme 'static'"),
                          ({"fmt": "e5m2"}, "FP8 format 'e5m2'"),
                          ({"weight_block_size": None}, "per-tensor FP8 is not supported")]:
        with pytest.raises(ModelError, match=match):
            Fp8Scheme.from_config({"quantization_config": {**good, **change}})


# -- against transformers on the dequantized weights --------------------------------------------


def test_deepseek_fp8_matches_transformers_on_the_dequantized_weights(deepseek_models, tmp_path):
    path = deepseek_models["deepseek-fp8"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                          "activation_scheme": "dynamic"}
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (14, 2)  # 224 x 32 in 16x16
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays
    ref = hf_model(dequantized_copy(path, tmp_path / "plain"))
    prompts = prompts_of([4, 30, 70], ref.config.vocab_size, seed=6)
    engine = Engine(EngineConfig(path, num_kv_blocks=128, block_size=8))
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == [hf_greedy(ref, p, 16) for p in prompts]
    # dequantized at load: the layers hold the model's dtype, not FP8
    assert all(p.dtype != FP8_DTYPE for p in engine.model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_llama_and_qwen_fp8_checkpoints_match_transformers(hf_checkpoints, family, tmp_path):
    """Blocks of 24x40 leave partial edge blocks in both dims of every projection (64, 160, 32...)."""
    src = hf_checkpoints[family]
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [24, 40],
                                  "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    save_file(quantize_checkpoint(load_file(str(src / "model.safetensors")), (24, 40)), str(fp8 / "model.safetensors"))
    ref = hf_model(dequantized_copy(fp8, tmp_path / "plain"))
    prompts = prompts_of([5, 33], ref.config.vocab_size, seed=7)
    seqs = Engine(EngineConfig(fp8, num_kv_blocks=64)).generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == [hf_greedy(ref, p, 16) for p in prompts]


# -- broken FP8 checkpoints: one line each --------------------------------------------------------


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


SCALE = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.pop(SCALE), r"FP8 weight model.layers.1.self_attn.kv_b_proj.weight has no "
                             r"model.layers.1.self_attn.kv_b_proj.weight_scale_inv"),
    (lambda t: t.update({SCALE: t[SCALE][:, :1].contiguous()}),
     r"kv_b_proj.weight_scale_inv has shape \(14, 1\), expected \(14, 2\) for a weight of \(224, 32\) in blocks of 16x16"),
])
def test_missing_or_misshaped_scales_are_one_line_errors(deepseek_models, tmp_path, edit, match):
    bad = _broken(deepseek_models["deepseek-fp8"], tmp_path / "bad", edit)
    with pytest.raises(ModelError, match=match) as e:
        Engine(EngineConfig(bad, num_kv_blocks=16))
    assert "\n" not in str(e.value)
    out = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(bad), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1 and "weight_scale_inv" in out.stderr


def test_fp8_weights_without_a_quantization_config_are_refused(deepseek_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(deepseek_models["deepseek-fp8"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"is float8 but config\.json has no quantization_config"):
        Engine(EngineConfig(bad, num_kv_blocks=16))


def test_the_config_names_the_scheme(deepseek_models):
    assert ModelConfig.from_dir(deepseek_models["deepseek-fp8"]).fp8 == Fp8Scheme((16, 16))
    assert ModelConfig.from_dir(deepseek_models["deepseek"]).fp8 is None


# -- FP8 resident (the GPU path, run here with the per-matmul dequantizing GEMM) -------------------


def test_resident_fp8_layers_give_the_dequantized_models_tokens(deepseek_models, monkeypatch):
    path = deepseek_models["deepseek-fp8"]
    prompts = prompts_of([4, 30, 70], 4096, seed=6)
    expected = [s.output_token_ids for s in Engine(EngineConfig(path, num_kv_blocks=64)).generate(prompts, GREEDY)]
    monkeypatch.setattr(loader, "resident_gemm", lambda *args: DequantGemm())
    engine = Engine(EngineConfig(path, num_kv_blocks=64))
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    # per layer q_a, q_b, kv_a, o; the dense MLP's gate_up and down; the shared experts' (kv_b_proj
    # is absorbed, not a linear layer, and the stacked experts are dequantized)
    assert len(layers) == 3 * 4 + 2 + 2 * 2
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale_inv.dtype == torch.float32 for m in layers)
    q_a = engine.model.layers[1].self_attn.q_a_proj
    stored = load_file(str(path / "model.safetensors"))
    assert torch.equal(q_a.weight.view(torch.uint8), stored["model.layers.1.self_attn.q_a_proj.weight"].view(torch.uint8))
    assert torch.equal(q_a.weight_scale_inv, stored["model.layers.1.self_attn.q_a_proj.weight_scale_inv"])
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected


def test_only_block_aligned_layers_stay_resident(hf_checkpoints, tmp_path, monkeypatch):
    """In 24x40 blocks the fused layers are not block-aligned (qkv: q's 64 rows end inside a block;
    gate_up: gate's 160 rows too), so they dequantize; o_proj and down_proj, each one whole tensor
    (partial edge blocks are fine for the dequant GEMM), stay FP8."""
    src = hf_checkpoints["llama"]
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [24, 40]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    save_file(quantize_checkpoint(load_file(str(src / "model.safetensors")), (24, 40)), str(fp8 / "model.safetensors"))
    expected = Engine(EngineConfig(fp8, num_kv_blocks=32)).generate([[1, 2, 3, 4, 5]], GREEDY)[0].output_token_ids
    monkeypatch.setattr(loader, "resident_gemm", lambda *args: DequantGemm())
    engine = Engine(EngineConfig(fp8, num_kv_blocks=32))
    resident = [name for name, m in engine.model.named_modules() if isinstance(m, Fp8Linear)]
    assert resident == [f"layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.o_proj", "mlp.down_proj")]
    assert engine.generate([[1, 2, 3, 4, 5]], GREEDY)[0].output_token_ids == expected
