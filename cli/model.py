"""``mesh model``: model utilities (``mesh model tiny``: a random-weight checkpoint to run)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    t = msub.add_parser("tiny", help="write a random-weight Llama (or Qwen3-MoE, DeepSeek-V3) checkpoint with a "
                                     "real tokenizer")
    t.add_argument("dir", help="output directory")
    t.add_argument("--size", default="tiny", choices=["tiny", "small", "moe", "small-moe", "deepseek", "deepseek-yarn"],
                   help="moe, small-moe: a mixture-of-experts Qwen3-MoE checkpoint; deepseek: a DeepSeek-V3 "
                        "(MLA, DeepSeekMoE, one MTP layer; needs transformers), deepseek-yarn: the same with "
                        "q_lora_rank null and YaRN rope scaling")
    t.add_argument("--fp8", action="store_true",
                   help="FP8 weights in DeepSeek's block-scaled format (e4m3, a float32 scale per block)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=run_tiny)


def run_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import write_tiny_model

    out = write_tiny_model(args.dir, size=args.size, seed=args.seed, fp8=args.fp8)
    print(out)
    return 0
