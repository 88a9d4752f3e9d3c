"""Mixture-of-experts benchmark, run through ``python bench/engine.py --moe``.

    python bench/engine.py --moe            # CPU: the tiny and the small-sized Qwen3-MoE vs transformers
    python bench/engine.py --moe --quick    # a short smoke run
    python bench/engine.py --moe --gpu      # CUDA: an 8B-active-shaped MoE (Mixtral layout, 8 experts,
                                            # top-2, Llama-3-8B attention), bf16, fused vs grouped experts,
                                            # against the HBM roofline

CPU: the same measurements as the dense comparison of ``bench/engine.py`` (decode tok/s at
batch 1, 8 and 32, prefill tok/s; same definitions, both engines in the same run), on
``mesh model tiny --size moe`` (8 experts, top-2, ~0.7M params) and ``--size small-moe``
(8 experts of width 896, top-2: as many MLP columns per token as the dense ``small``,
~160M params). Ours runs the grouped experts (only the chosen experts, one matmul pair per
expert with tokens); transformers runs its default experts implementation (named in the header).

GPU: weights are random (no checkpoint); a decode step at batch 64 reads every weight once
(64 tokens x 2 experts reach all 8 experts of a layer with near certainty), so the roofline
is the whole model's bytes plus the KV the step attends over, at ``--hbm-tbps``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine import engine as engine_module
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.loader import build_model, use_default_experts

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


def moe_model(size: str) -> Path:
    from engine.tiny import write_tiny_model

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdmesh" / f"bench-{size}"
    if not (cache / "model.safetensors").is_file():
        print(f"writing the {size} model to {cache} ...", file=sys.stderr)
        write_tiny_model(cache, size=size, seed=0)
    return cache


def run_moe(args, bench) -> dict:
    """``bench``: the ``bench/engine.py`` module (its runners, cases, measuring and table)."""
    if args.gpu:
        return run_moe_gpu(args, bench)
    import transformers

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    reps = args.reps or (1 if args.quick else 3)
    cases = [c for c in bench.build_cases(args.quick, args.seed) if "mixed" not in c.label]
    out = {"mode": "cpu-moe", "threads": threads, "torch": torch.__version__,
           "transformers": transformers.__version__, "reps": reps, "models": []}
    for size in ("moe", "small-moe"):
        model_dir = moe_model(size)
        mc = ModelConfig.from_dir(model_dir)
        ours, hf = bench.OursRunner.on_cpu(model_dir, cases), bench.HFRunner(model_dir)
        params = sum(p.numel() for p in hf.model.parameters())
        active = params - mc.num_layers * (mc.moe.num_experts - mc.moe.top_k) * 3 * mc.hidden_size * mc.moe.intermediate_size
        experts_impl = getattr(hf.model.config, "_experts_implementation", None) or "eager"
        header = (
            f"MoE engine benchmark: {model_dir.name} (Qwen3-MoE, {mc.moe.num_experts} experts, top-{mc.moe.top_k}, "
            f"{params / 1e6:.1f}M params, {active / 1e6:.1f}M active per token, fp32) on CPU "
            f"({platform.processor() or platform.machine()}, {threads} threads), torch {torch.__version__}, "
            f"transformers {transformers.__version__} (experts: {experts_impl}); ours: grouped experts\n"
            f"decode tok/s = B / decode step (median step of a run, best of {reps} runs); prefill tok/s = "
            f"prompt tokens / best t(1); t(N)-t(1) = the whole-call cross-check of bench/engine.py\n"
        )
        rows = []
        for i, case in enumerate(cases):
            prompts = bench.make_prompts(case, mc.vocab_size, args.seed + i)
            wall, cpu = time.perf_counter(), time.process_time()
            row = bench.measure(case, [ours, hf], prompts, reps)
            row.cpu_share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * threads)
            rows.append(row)
            print(f"  measured {size} {case.label} batch {case.batch} ({row.cpu_share:.0%} of {threads} CPUs)",
                  file=sys.stderr)
        bench.print_table(rows, header, target=None)  # issue 19 sets no CPU ratio
        busy = [r for r in rows if r.cpu_share < bench.BUSY_SHARE]
        if busy:
            print(f"warning: other processes took CPU time during {len(busy)} case(s) (as little as "
                  f"{min(r.cpu_share for r in busy):.0%} of the CPUs here); those figures are noisy.")
        print()
        out["models"].append({"model": str(model_dir), "params": params, "active_params": active,
                              "hf_experts": experts_impl,
                              "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]})
        del ours, hf
    return out


# -- GPU: an 8B-active-shaped MoE, random bf16 weights, fused vs grouped experts ------------------


@contextlib.contextmanager
def random_moe_weights(experts: str, seed: int = 0):
    """Let ``Engine`` build the model with random weights on its device (as ``bench/engine.py``'s
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


def run_moe_gpu(args, bench) -> dict:
    if not torch.cuda.is_available():
        sys.exit(f"bench/engine.py --moe --gpu: CUDA is not available here (torch {torch.__version__})")
    runs = []
    for experts in ("default", "grouped"):  # default on CUDA bf16: FlashInfer's fused kernel when installed
        try:
            runs.append(_gpu_moe_decode(args, bench, experts))
        except (ValueError, ImportError, RuntimeError) as e:
            print(f"bench/engine.py --moe --gpu: experts {experts!r} did not run: {str(e).splitlines()[0]}",
                  file=sys.stderr)
        torch.cuda.empty_cache()
    if len(runs) == 2:
        print(f"decode {runs[0]['experts']} / grouped: {runs[0]['decode_tok_s'] / runs[1]['decode_tok_s']:.2f}x")
    return {"mode": "gpu-moe", "runs": runs}


def _gpu_moe_decode(args, bench, experts: str) -> dict:
    batches = [int(b) for b in args.gpu_batches.split(",")]
    shape, batch = MOE_8B_ACTIVE_SHAPE, 64 if 64 in batches else max(batches)
    prompt, new = (128, 32) if args.quick else (args.gpu_prompt, args.gpu_new_tokens)
    model_dir = Path(tempfile.mkdtemp(prefix="pdmesh-random-moe-"))
    (model_dir / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    with random_moe_weights(experts, args.seed):
        engine = Engine(EngineConfig(
            model_dir, device="cuda", dtype="bfloat16", block_size=bench.BLOCK_SIZE,
            num_kv_blocks=batch * -(-(prompt + new) // bench.BLOCK_SIZE) + 16,
            max_num_batched_tokens=batch * prompt, max_num_seqs=batch, max_model_len=prompt + new + 16,
            enable_prefix_caching=False, attention_backend=args.gpu_attention,
        ))
    name = engine.model.layers[0].mlp.experts.name
    runner = bench.OursRunner(engine)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, shape["vocab_size"]) for _ in range(prompt)] for _ in range(batch)]
    runner.generate(prompts, 4)  # warm-up (JIT, autotuning)
    t1, steps = [], []
    for _ in range(args.reps or 2):
        t1.append(runner.generate(prompts, 1)[0])
        steps.append(statistics.median(bench.decode_gaps(runner.generate(prompts, new)[1])))
    step = min(steps)
    mc = engine.model_config
    weights = bench._gpu_module().weight_bytes_per_step(engine.model, batch)  # every expert is hit at this batch
    kv = batch * (prompt + new // 2) * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    roofline = (weights + kv) / (args.hbm_tbps * 1e12)
    print(f"MoE engine benchmark (GPU): 8B-active Mixtral-layout shape ({mc.moe.num_experts} experts, top-"
          f"{mc.moe.top_k}), random bf16 weights, {torch.cuda.get_device_name()}, experts {name}")
    print(f"batch {batch}, prompt {prompt}, {new} new tokens")
    print(f"  prefill   {batch * prompt / min(t1):>10.0f} tok/s")
    print(f"  decode    {batch / step:>10.0f} tok/s   ({step * 1e3:.2f} ms/step; roofline {roofline * 1e3:.2f} ms: "
          f"weights {weights / 1e9:.1f} GB + KV {kv / 1e9:.2f} GB at {args.hbm_tbps} TB/s = "
          f"{roofline / step:.0%} of the roofline)")
    del engine, runner
    return {"experts": name, "batch": batch, "prompt": prompt, "new_tokens": new, "step_ms": step * 1e3,
            "decode_tok_s": batch / step, "prefill_tok_s": batch * prompt / min(t1),
            "roofline_step_ms": roofline * 1e3, "weight_bytes": weights, "kv_bytes": kv}
