"""``mesh generate``: run the engine in this process and print completions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.flags import CliError
from engine import flags as engine_flags


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="run the engine in this process and print completions")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    engine_flags.add_kv_cache_dtype_arg(p)
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-kv-blocks", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    engine_flags.add_lora_args(p)
    engine_flags.add_speculative_args(p)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME",
                   help="run the prompts on this --lora adapter (once: every prompt; once per prompt: in order; "
                        "'' for the base model)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig, ModelConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from mesh.tokenizer import Tokenizer

    model = Path(args.model)
    ModelConfig.from_dir(model)  # names a missing or unsupported model before anything loads
    tokenizer = Tokenizer(model)
    adapters = args.adapter or [""]
    if len(adapters) not in (1, len(args.prompts)):
        raise CliError(f"--adapter given {len(adapters)} times for {len(args.prompts)} prompts: give it once, "
                       "or once per prompt")
    engine = Engine(EngineConfig(model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                 device=args.device, block_size=args.block_size,
                                 num_kv_blocks=args.device_kv_blocks, **engine_flags.lora_fields(args),
                                 **engine_flags.speculative_fields(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    prompts = [tokenizer.encode(p) for p in args.prompts]
    names = [name or None for name in adapters * (len(prompts) // len(adapters))]
    seqs = engine.generate(prompts, params, lora=names)
    for text, ids, seq in zip(args.prompts, prompts, seqs, strict=True):
        completion = tokenizer.decode(seq.output_token_ids)
        if args.json:
            print(json.dumps({
                "prompt": text,
                "adapter": seq.lora.name if seq.lora else None,
                "prompt_token_ids": ids,
                "token_ids": seq.output_token_ids,
                "text": completion,
                "finish_reason": seq.status.finish_reason,
            }))
        else:
            print(f"{text}{completion}")
    return 0
