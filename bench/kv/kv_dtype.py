"""FP8 KV cache against a bf16 one (``--kv-cache-dtype``, issue 49): greedy agreement, logprob
drift, bytes per token and decode speed, in-process.

    python -m bench kv-dtype            # `small`, 8 prompts x 64 greedy tokens, ~2 min on 2 cores
    python -m bench kv-dtype --quick    # `tiny`, 2 prompts x 8 tokens

Every engine computes in float32 on CPU (bfloat16 on CUDA); only its KV cache differs:
``bfloat16`` (the reference), ``fp8_e4m3``, ``fp8_e5m2``, and ``auto`` (the float32 cache: the
model's sensitivity to a cache's rounding at all). Per cache, against the reference:

- ``greedy_match``: the share of the prompts x tokens greedy tokens equal to the reference's at
  the same position, each engine running free (one different token changes the context of
  every token after it, so a sequence that diverges rarely matches again);
- ``forced_match``: teacher-forced: at each position of the reference's greedy continuation,
  given the same context, does this cache choose the reference's token (one prefill of
  prompt + continuation, every row's logits);
- ``mean_abs_logprob_diff``: of the reference's chosen token at each of those positions,
  |logprob here - logprob there|, teacher-forced;
- ``kv_bytes_per_token``: the pool's own tensor, ``nbytes / (blocks x block size)``;
- ``decode_tok_s``: batch (the prompts) x steps / the decode steps' time, one run.

Why teacher-forced too: the generated models have random weights, whose greedy choices are
often near ties (on `small`, 10% of positions have a top-2 logprob gap under 0.45), so the
free-running match measures the model's chaos as much as the cache; forcing the context
counts only the choices the cache itself changes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import model_dir as resolve_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

BENCHMARK = Benchmark(
    name="kv-dtype",
    measures="FP8 KV cache (--kv-cache-dtype fp8_e4m3, fp8_e5m2) against a bf16 one on `small`: greedy token "
             "match (free-running and teacher-forced), mean |logprob| difference, KV bytes per token, decode tok/s",
    target=">= 90% of the greedy tokens match the bf16 cache; KV bytes per token exactly half",
    minutes=2,
    smoke=("--quick", "--caches", "bfloat16,fp8_e4m3", "--threads", "1"),
)

REFERENCE = "bfloat16"
CACHES = (REFERENCE, "fp8_e4m3", "fp8_e5m2", "auto")
BLOCK_SIZE = 16


@dataclass
class CacheRun:
    """One KV cache dtype's figures against the reference cache."""

    kv_cache_dtype: str
    dtype: str  # the pool's torch dtype
    kv_bytes_per_token: float
    greedy_match: float
    forced_match: float
    mean_abs_logprob_diff: float
    decode_tok_s: float


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine_for(model, kv_cache_dtype: str, blocks: int, device: str | None = None) -> Engine:
    """An engine computing in float32 on CPU (bf16 on CUDA) over a ``kv_cache_dtype`` cache; no
    prefix caching, so a teacher-forced prefill computes every row."""
    dtype = "bfloat16" if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") \
        else "float32"
    return Engine(EngineConfig(model=model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype,
                               num_kv_blocks=blocks, block_size=BLOCK_SIZE, enable_prefix_caching=False))


def greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """The greedy continuations, and decode tok/s (the steps after the first, which prefills)."""
    seqs = [engine.new_sequence(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            for p in prompts]
    for s in seqs:
        engine.add(s)
    engine.step()  # the prompts' prefill (they fit one step), and the first token
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    return [s.output_token_ids for s in seqs], len(prompts) * steps / seconds if steps else 0.0


def forced_logprobs(engine: Engine, prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """``[prompts, tokens, vocab]`` log-probabilities of each continuation token's position, the
    context forced to prompt + continuation: one prefill step, every row's logits kept."""
    engine.runner.capture_logits = True
    seqs = [engine.new_sequence(p + c, SamplingParams(max_tokens=1, temperature=0.0))
            for p, c in zip(prompts, continuations, strict=True)]
    for s in seqs:
        engine.add(s)
    engine.step()
    rows = engine.runner.last_logits.float().log_softmax(-1)
    engine.runner.capture_logits = False
    while engine.has_work:
        engine.step()
    out, row = [], 0
    for p, c in zip(prompts, continuations, strict=True):
        out.append(rows[row + len(p) - 1 : row + len(p) - 1 + len(c)])  # the rows that predict c
        row += len(p) + len(c)
    if row != rows.shape[0]:
        raise RuntimeError(f"the forced prefill took {rows.shape[0]} rows in one step, not {row}")
    return torch.stack(out)


def pool_bytes_per_token(engine: Engine) -> float:
    """KV bytes per token from the pool's own tensor (all layers, K and V or the latent)."""
    spec = engine.kv_spec
    return engine.kv_cache.tensor.nbytes / (spec.num_blocks * spec.block_size)


def compare_caches(model, caches=CACHES, prompts: int = 8, prompt_len: int = 32, tokens: int = 64,
                   device: str | None = None, seed: int = 0, free_running: bool = True) -> list[CacheRun]:
    """Each of ``caches`` against the first (the reference), on the same prompts; without
    ``free_running`` only the reference generates (the others' ``greedy_match`` and
    ``decode_tok_s`` are then NaN)."""
    from engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    batch = make_prompts(prompts, prompt_len, vocab, seed)
    blocks = prompts * -(-(prompt_len + tokens) // BLOCK_SIZE) + 4
    runs, ref_tokens, ref_lp = [], None, None
    for name in caches:
        engine = engine_for(model, name, blocks, device)
        try:
            outs, tok_s = greedy(engine, batch, tokens) if free_running or ref_tokens is None else (None, math.nan)
            if ref_tokens is None:
                ref_tokens = outs
            lp = forced_logprobs(engine, batch, ref_tokens)
            if ref_lp is None:
                ref_lp = lp
            chosen = ref_lp.argmax(-1, keepdim=True)  # the reference's choice, teacher-forced
            same = math.nan if outs is None else sum(
                a == b for x, y in zip(outs, ref_tokens, strict=True) for a, b in zip(x, y, strict=True))
            runs.append(CacheRun(
                name, str(engine.kv_spec.dtype).removeprefix("torch."), pool_bytes_per_token(engine),
                greedy_match=same / (prompts * tokens),
                forced_match=(lp.argmax(-1, keepdim=True) == chosen).float().mean().item(),
                mean_abs_logprob_diff=(lp.gather(-1, chosen) - ref_lp.gather(-1, chosen)).abs().mean().item(),
                decode_tok_s=tok_s))
        finally:
            engine.close()
    return runs


def print_table(runs: list[CacheRun], header: str) -> None:
    print(header)
    print(f"{'cache':<10} {'dtype':<14} {'KV B/token':>10} {'greedy':>7} {'forced':>7} {'|dlogp|':>8} {'tok/s':>7}")
    for r in runs:
        print(f"{r.kv_cache_dtype:<10} {r.dtype:<14} {r.kv_bytes_per_token:>10.0f} {r.greedy_match:>7.1%} "
              f"{r.forced_match:>7.1%} {r.mean_abs_logprob_diff:>8.4f} {r.decode_tok_s:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", default=None, help="model directory, or a generated size (default: small)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--caches", default=",".join(CACHES),
                   help=f"--kv-cache-dtype values, the reference first (default: {','.join(CACHES)})")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="`tiny`, 2 prompts x 8 tokens")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parse(BENCHMARK, p, argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.model, args.prompts, args.tokens = args.model or "tiny", 2, 8
    model = resolve_model(args.model)
    runs = compare_caches(model, args.caches.split(","), prompts=args.prompts, prompt_len=args.prompt_len, tokens=args.tokens,
                          device=args.device, seed=args.seed)
    ref = runs[0]
    print_table(runs, f"KV cache dtypes on {model.name}: {args.prompts} prompts x {args.tokens} greedy tokens "
                      f"against the {runs[0].kv_cache_dtype} cache ({args.threads} threads, load {os.getloadavg()[0]:.1f})")
    half = {r.kv_cache_dtype: r.kv_bytes_per_token * 2 == ref.kv_bytes_per_token for r in runs if "fp8" in r.kv_cache_dtype}
    return emit(BENCHMARK, {"model": model.name, "prompts": args.prompts, "tokens": args.tokens,
                            "reference": ref.kv_cache_dtype, "runs": [asdict(r) for r in runs],
                            "fp8_bytes_exactly_half": half}, args)
