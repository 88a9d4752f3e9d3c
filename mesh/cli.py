"""The ``mesh`` command line.

Each subcommand's work lives in its own module and is imported only when that
subcommand runs. Errors a user can fix print as one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run the engine in this process and print completions")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-kv-blocks", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=cmd_generate)


def _add_model(sub) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    t = msub.add_parser("tiny", help="write a random-weight Llama checkpoint with a real tokenizer")
    t.add_argument("dir", help="output directory")
    t.add_argument("--size", default="tiny", choices=["tiny", "small"])
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_model_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="pdmesh: disaggregated prefill/decode serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_model(sub)
    _add_generate(sub)
    return parser


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from mesh.engine.tiny import write_tiny_model

    out = write_tiny_model(args.dir, size=args.size, seed=args.seed)
    print(out)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from mesh.engine import Engine, EngineConfig, ModelConfig, SamplingParams
    from mesh.tokenizer import Tokenizer

    model = Path(args.model)
    ModelConfig.from_dir(model)  # names a missing or unsupported model before anything loads
    tokenizer = Tokenizer(model)
    engine = Engine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_kv_blocks=args.device_kv_blocks,
        )
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = [tokenizer.encode(p) for p in args.prompts]
    seqs = engine.generate(prompts, params)
    for text, ids, seq in zip(args.prompts, prompts, seqs, strict=True):
        completion = tokenizer.decode(seq.output_token_ids)
        if args.json:
            print(json.dumps({
                "prompt": text,
                "prompt_token_ids": ids,
                "token_ids": seq.output_token_ids,
                "text": completion,
                "finish_reason": seq.status.finish_reason,
            }))
        else:
            print(f"{text}{completion}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from mesh.engine import ModelError, RequestError

    try:
        return args.func(args)
    except (CliError, ModelError, RequestError, ValueError, OSError) as e:
        print(f"mesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
