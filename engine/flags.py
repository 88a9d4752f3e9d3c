"""The model engine's command-line flags: ``add_args`` puts them on a parser, ``from_args``
makes the ``EngineConfig`` and checks them (a ValueError of one line each).

Beside ``engine.config`` rather than in it: the ``mesh`` command builds every subcommand's
parser when it starts (the gateway's too), and ``engine.config`` loads torch. This module
imports nothing of the engine until a config is made.

The mocker (``mocker.engine.MockConfig``) reads some of these flags too: the model it
simulates, its block size and pool, its KV tiers in blocks.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig


def add_args(p: argparse.ArgumentParser, multi_model: bool = False) -> None:
    """The flags of a worker's engine (``multi_model``: ``--model`` repeats, for ``mesh up``)."""
    if multi_model:
        p.add_argument("--model", action="append", default=None,
                       help="Hugging Face model directory; repeat to serve several models on one mesh")
    else:
        p.add_argument("--model", default=None, help="Hugging Face model directory")
    p.add_argument("--served-name", default=None, help="model name on the bus and in the API (default: the directory name)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-kv-blocks", type=int, default=None, help="cap the device KV pool (default: what memory allows)")
    p.add_argument("--host-kv-gb", type=float, default=None, help="host KV tier: offload cold blocks to this much RAM (pinned on GPU)")
    p.add_argument("--disk-kv-dir", default=None, help="disk KV tier: keep reused blocks evicted from the host tier here")
    p.add_argument("--disk-kv-gb", type=float, default=None, help="cap of the disk KV tier (default 8)")
    p.add_argument("--host-kv-blocks", type=int, default=None,
                   help="host KV tier in blocks (instead of --host-kv-gb; the mocker's virtual host tier)")
    p.add_argument("--disk-kv-blocks", type=int, default=None,
                   help="cap of the disk KV tier in blocks (instead of --disk-kv-gb; the mocker's virtual disk tier)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-with-decode", type=int, default=512,
                   help="at most this many prompt tokens in a step that also decodes, so admissions never "
                        "stall running streams for more than ~one step (stall-free batching; 0: no cap)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.85,
                   help="GPU: the share of the device this worker may use, weights and KV (two models on one GPU: 0.4 each)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel: shard the model over this many ranks (processes; one GPU each on CUDA)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel (MoE models): spread the routed experts over this many ranks, the --tp "
                        "ranks first, then ranks that hold experts only; tokens go to their experts' ranks "
                        "by all-to-all (a multiple of --tp; attention stays --tp)")
    add_pipeline_args(p)
    add_gpu_execution_args(p)
    p.add_argument("--grammar-backend", default="llguidance", choices=("llguidance", "xgrammar"),
                   help="grammar engine of constrained output (xgrammar: pip install pdmesh[xgrammar])")
    p.add_argument("--grammar-threads", type=int, default=0,
                   help="threads that fill the token masks of constrained rows (0: the grammar engine's default)")
    p.add_argument("--grammar-spin-ms", type=float, default=3.0,
                   help="how long the grammar process polls for the next step before it sleeps (0: it always "
                        "sleeps; each step's message then wakes it, ~60 us of the engine thread on a small VM)")
    add_lora_args(p)
    add_speculative_args(p)


def from_args(args: argparse.Namespace) -> EngineConfig:
    """A model worker's ``EngineConfig`` from the flags of ``add_args`` (ValueError: a flag it cannot
    take; ModelError: the model directory or a ``--lora`` adapter), read once before anything starts."""
    from engine.config import EngineConfig, ModelConfig
    from engine.mtp import check_mtp
    from mesh.config import settings

    if getattr(args, "peer_fetch", False) and not (args.host_kv_gb or args.host_kv_blocks):
        raise ValueError("--peer-fetch needs a host KV tier (--host-kv-gb or --host-kv-blocks): "
                         "fetched blocks are staged and sent through it")
    if getattr(args, "mock_timing", None):
        raise ValueError("--mock-timing is for the mocker")
    model = args.model or settings().model
    if not model:
        raise ValueError("--model DIR is required (or MESH_MODEL)")
    mc = ModelConfig.from_dir(model)
    mc.check_tp(args.tp, args.ep)
    mc.check_ep(args.ep)
    pipeline = pipeline_fields(args)
    check_mtp(mc, args.speculative)  # a checkpoint without the layer: one line, before a worker starts
    tiers = {"host_kv_gb": args.host_kv_gb, "disk_kv_dir": args.disk_kv_dir, "disk_kv_gb": args.disk_kv_gb,
             "host_kv_blocks": args.host_kv_blocks, "disk_kv_blocks": args.disk_kv_blocks}
    config = EngineConfig(
        model=model, served_name=args.served_name, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size, num_kv_blocks=args.device_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_with_decode=args.max_prefill_with_decode,
        tp=args.tp, ep=args.ep, **pipeline,
        kv_memory_fraction=args.kv_memory_fraction, **gpu_execution_fields(args),
        grammar_backend=args.grammar_backend, grammar_threads=args.grammar_threads,
        grammar_spin_ms=args.grammar_spin_ms, **speculative_fields(args), **{k: v for k, v in tiers.items() if v is not None}, **lora_fields(args),
    )
    check_loras(config, mc)
    check_layout(config, mc, getattr(args, "local_ranks", 0) or None)  # a worker's --local-ranks: the others elsewhere
    return config


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    # checked by EngineConfig, not by argparse's choices: a bad value is one line, not usage + error
    p.add_argument("--kv-cache-dtype", default="auto", metavar="auto|fp8|fp8_e4m3|fp8_e5m2",
                   help="the KV pool's dtype: auto (the model's, --dtype) or FP8 (fp8 = fp8_e4m3): half the "
                        "bytes of bf16 in the pool, the tiers and every transfer; one scale of 1.0 per tensor")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallel: split the decoder layers into this many stages, one rank each "
                        "(x --tp: TP inside each stage); activations pass stage to stage")
    p.add_argument("--pp-layers", default=None, metavar="N,N,...",
                   help="layers per stage (they sum to the model's layers; default: as even as they go)")
    p.add_argument("--pp-microbatches", type=int, default=0, metavar="M",
                   help="cut a step into up to M micro-batches so the stages work at once: a step with "
                        "prompt chunks, or every step with --pp-steps-in-flight 1 (default 0: --pp, one per "
                        "stage; 1: off)")
    p.add_argument("--pp-steps-in-flight", type=int, default=0, metavar="N",
                   help="keep up to N steps of different sequences in flight over the stages, so each stage "
                        "has one while rank 0 samples and schedules (default 0: --pp, one per stage; 1: off, "
                        "one step at a time, cut into micro-batches)")


def pipeline_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the pipeline flags (ValueError for a malformed ``--pp-layers``)."""
    from engine.parallel.layout import parse_stage_layers

    layers = parse_stage_layers(args.pp_layers) if args.pp_layers else ()
    return {"pp": args.pp, "pp_layers": layers, "pp_microbatches": args.pp_microbatches,
            "pp_steps_in_flight": args.pp_steps_in_flight}


def pipeline_argv(args: argparse.Namespace) -> list[str]:
    """The pipeline flags again, as given (for the workers ``mesh up`` starts); [] at PP 1."""
    if args.pp == 1:
        return []
    argv = ["--pp", str(args.pp)]
    if args.pp_layers:
        argv += ["--pp-layers", args.pp_layers]
    if args.pp_microbatches:
        argv += ["--pp-microbatches", str(args.pp_microbatches)]
    return argv + (["--pp-steps-in-flight", str(args.pp_steps_in_flight)] if args.pp_steps_in_flight else [])


def check_layout(config: EngineConfig, mc: ModelConfig, here: int | None = None) -> None:
    """The ranks' layout against the model and the devices, before anything starts (ValueError
    in one line: more stages than layers, a split that does not add up, too few GPUs for the
    ``here`` ranks on this host, default all)."""
    from engine.parallel.group import check_devices
    from engine.parallel.layout import Layout

    layout = Layout.for_model(config.tp, config.pp, mc.num_layers, config.pp_layers, config.ep)
    check_devices(config.torch_device, layout, min(here or layout.size, layout.size))


def check_loras(config: EngineConfig, mc: ModelConfig) -> None:
    """Read every ``--lora`` adapter once before anything starts: a broken directory is one line
    naming the file (LoraError), not a worker that dies after joining the mesh."""
    from engine.lora import read_adapter

    for name, path in config.loras:
        read_adapter(name, path, mc, config.model_name, config.max_lora_rank)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding: ngram (prompt lookup; ngram:N matches up to N tokens), "
                        "draft:DIR (a smaller model with the same tokenizer), eagle3:DIR (an EAGLE-3 "
                        "head, its published checkpoint format, fed the target's hidden states), or mtp "
                        "(DeepSeek-V3's multi-token-prediction layer, stored in its checkpoint)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="tokens a decoding row drafts per step (with --speculative)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="K adapts per row to its acceptance, down to no drafts (default); "
                        "--no-speculative-adaptive: every decoding row drafts K tokens every step")


def speculative_fields(args: argparse.Namespace) -> dict:
    return {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
            "spec_adaptive": args.speculative_adaptive}


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative flags again, as given (for the workers ``mesh up`` starts); [] when off."""
    if not args.speculative:
        return []
    argv = ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    return argv if args.speculative_adaptive else [*argv, "--no-speculative-adaptive"]


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="load a LoRA adapter (PEFT directory) under NAME; repeatable")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapters one step can run (device slots, least recently used out); "
                        "default 4 with --lora, else LoRA is off")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank the slots hold")


def lora_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the LoRA flags (ValueError for a malformed ``--lora``)."""
    loras = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=DIR, got {spec!r}")
        loras.append((name, path))
    return {"loras": tuple(loras), "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}


def add_gpu_execution_args(p: argparse.ArgumentParser) -> None:
    """How a model worker runs on a GPU (issue 21): each off by default until measured on one."""
    p.add_argument("--attention-backend", default=None,
                   help="flashinfer (CUDA default), flashinfer-ragged (prefill over this step's K/V as a ragged "
                        "batch plus the cached prefix) or torch (CPU default)")
    p.add_argument("--cuda-graphs", action="store_const", const=True, default=None,
                   help="GPU: replay decode steps from CUDA graphs (FlashInfer attention, --tp 1)")
    p.add_argument("--enforce-eager", action="store_true", help="GPU: never use CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling and output processing with the device's step (--tp 1)")
    p.add_argument("--fused-kernels", default="",
                   help="GPU: FlashInfer kernels for these ops, comma-separated: add_rmsnorm, silu_and_mul, "
                        "rope, sampling; or all")


def gpu_execution_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of ``add_gpu_execution_args`` (ValueError on a bad value)."""
    from engine.kernels import parse_fused_kernels

    return {"attention_backend": args.attention_backend, "cuda_graphs": args.cuda_graphs,
            "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
            "fused_kernels": parse_fused_kernels(args.fused_kernels)}


def gpu_execution_argv(args: argparse.Namespace) -> list[str]:
    """The same flags again, as given (for the workers ``mesh up`` starts); [] when none is."""
    argv = []
    if args.attention_backend:
        argv += ["--attention-backend", args.attention_backend]
    if args.cuda_graphs:
        argv += ["--cuda-graphs"]
    if args.enforce_eager:
        argv += ["--enforce-eager"]
    if args.async_scheduling is not None:
        argv += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    if args.fused_kernels:
        argv += ["--fused-kernels", args.fused_kernels]
    return argv
