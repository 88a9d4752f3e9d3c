"""Mixture-of-experts engine benchmark on a GPU: an 8B-active MoE against its HBM roofline.

    python -m bench moe-gpu              # CUDA: a Mixtral-layout shape (8 experts, top-2, Llama-3-8B
                                         # attention), random bf16 weights, fused vs grouped experts
    python -m bench moe-gpu --dry-run    # the same code on the CPU with a tiny shape (plumbing only)

Weights are random (no checkpoint); a decode step at batch 64 reads every weight once
(64 tokens x 2 experts reach all 8 experts of a layer with near certainty), so the roofline
is the whole model's bytes plus the KV the step attends over, at ``--hbm-tbps``. The CPU
comparison with transformers is ``python -m bench moe``.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.engine import engine as compare
from bench.gpu import engine_gpu
from engine import engine as engine_module
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.loader import build_model, use_default_experts

BENCHMARK = Benchmark(
    name="moe-gpu",
    measures="decode and prefill tok/s of an 8B-active Mixtral-shaped MoE (random bf16) against the HBM roofline, "
             "FlashInfer's fused experts vs our grouped ones (CUDA)",
    minutes=3,
    smoke=("--dry-run",),
)
MOE_8B_ACTIVE_SHAPE = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 7168,  # per expert: two of them are Llama-3-8B's 14336 columns
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DRY_RUN_SHAPE = {**MOE_8B_ACTIVE_SHAPE, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                 "max_position_embeddings": 1024, "torch_dtype": "float32"}


@contextlib.contextmanager
def random_moe_weights(experts: str, seed: int = 0):
    """Let ``Engine`` build the model with random weights on its device (as ``bench/gpu/engine_gpu.py``'s
    ``random_weights``), then give its MoE layers ``experts`` ("default": the device's choice)."""
    from engine.moe import create_experts

    def load_random(cfg: ModelConfig, device, dtype, max_positions, **kwargs):
        model = build_model(cfg, device, dtype, max_positions, **kwargs)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:  # fan-in is the last dimension (stacked experts are [E, out, in])
                    p.normal_(0.0, 0.2 if name.startswith("embed_tokens") else p.shape[-1] ** -0.5, generator=gen)
        if experts == "default":
            use_default_experts(model, device, dtype)
        else:
            for layer in model.layers:
                layer.mlp.use(create_experts(experts))
        return model

    original = engine_module.load_model
    engine_module.load_model = load_random
    try:
        yield
    finally:
        engine_module.load_model = original


def run_moe_gpu(args) -> dict:
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(f"python -m bench moe-gpu: CUDA is not available here (torch {torch.__version__}); "
                 "--dry-run runs the plumbing on the CPU")
    runs = []
    for experts in ("default", "grouped"):  # default on CUDA bf16: FlashInfer's fused kernel when installed
        try:
            runs.append(_gpu_moe_decode(args, experts))
        except (ValueError, ImportError, RuntimeError) as e:
            print(f"python -m bench moe-gpu: experts {experts!r} did not run: {str(e).splitlines()[0]}",
                  file=sys.stderr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(runs) == 2:
        print(f"decode {runs[0]['experts']} / grouped: {runs[0]['decode_tok_s'] / runs[1]['decode_tok_s']:.2f}x")
    return {"mode": "gpu-moe-dry-run" if args.dry_run else "gpu-moe", "runs": runs}


def _gpu_moe_decode(args, experts: str) -> dict:
    batches = [int(b) for b in args.gpu_batches.split(",")]
    shape, batch = MOE_8B_ACTIVE_SHAPE, 64 if 64 in batches else max(batches)
    prompt, new = (128, 32) if args.quick else (args.gpu_prompt, args.gpu_new_tokens)
    device, dtype, attention = "cuda", "bfloat16", args.gpu_attention
    if args.dry_run:  # a tiny shape on the CPU: the plumbing, not the hardware
        torch.set_num_threads(1)  # a tiny model: more threads only contend
        shape, batch, prompt, new = DRY_RUN_SHAPE, 4, 32, 8
        device, dtype, attention = "cpu", "float32", "torch"
    model_dir = Path(tempfile.mkdtemp(prefix="pdmesh-random-moe-"))
    (model_dir / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    with random_moe_weights(experts, args.seed):
        engine = Engine(EngineConfig(
            model_dir, device=device, dtype=dtype, block_size=compare.BLOCK_SIZE,
            num_kv_blocks=batch * -(-(prompt + new) // compare.BLOCK_SIZE) + 16,
            max_num_batched_tokens=batch * prompt, max_num_seqs=batch, max_model_len=prompt + new + 16,
            enable_prefix_caching=False, attention_backend=attention,
        ))
    name = engine.model.layers[0].mlp.experts.name
    runner = compare.OursRunner(engine)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, shape["vocab_size"]) for _ in range(prompt)] for _ in range(batch)]
    runner.generate(prompts, 4)  # warm-up (JIT, autotuning)
    t1, steps = [], []
    for _ in range(args.reps or 2):
        t1.append(runner.generate(prompts, 1)[0])
        steps.append(statistics.median(compare.decode_gaps(runner.generate(prompts, new)[1])))
    step = min(steps)
    mc = engine.model_config
    weights = engine_gpu.weight_bytes_per_step(engine.model, batch)  # every expert is hit at this batch
    elem = torch.empty((), dtype=engine.dtype).element_size()
    kv = batch * (prompt + new // 2) * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
    roofline = (weights + kv) / (args.hbm_tbps * 1e12)
    where = "DRY RUN on CPU (tiny shape, fp32): plumbing only" if args.dry_run else torch.cuda.get_device_name()
    print(f"MoE engine benchmark (GPU): 8B-active Mixtral-layout shape ({mc.moe.num_experts} experts, top-"
          f"{mc.moe.top_k}), random weights, {where}, experts {name}")
    print(f"batch {batch}, prompt {prompt}, {new} new tokens")
    print(f"  prefill   {batch * prompt / min(t1):>10.0f} tok/s")
    print(f"  decode    {batch / step:>10.0f} tok/s   ({step * 1e3:.2f} ms/step; roofline {roofline * 1e3:.2f} ms: "
          f"weights {weights / 1e9:.1f} GB + KV {kv / 1e9:.2f} GB at {args.hbm_tbps} TB/s = "
          f"{roofline / step:.0%} of the roofline)")
    del engine, runner
    return {"experts": name, "batch": batch, "prompt": prompt, "new_tokens": new, "step_ms": step * 1e3,
            "decode_tok_s": batch / step, "prefill_tok_s": batch * prompt / min(t1),
            "roofline_step_ms": roofline * 1e3, "weight_bytes": weights, "kv_bytes": kv}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--quick", action="store_true", help="prompt 128, 32 new tokens")
    p.add_argument("--reps", type=int, default=None, help="timed runs (best kept; default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny shape (plumbing only)")
    p.add_argument("--gpu-attention", default="flashinfer", help="attention backend")
    p.add_argument("--gpu-batches", default="1,64,256", help="decode batch sizes: 64 is measured if listed, "
                                                              "else the largest")
    p.add_argument("--gpu-prompt", type=int, default=512)
    p.add_argument("--gpu-new-tokens", type=int, default=128)
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth (H200: 4.8)")
    args = parse(BENCHMARK, p, argv)
    result = run_moe_gpu(args)
    emit(BENCHMARK, result, args)
    return 0 if result["runs"] else 1
