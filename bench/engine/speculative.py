"""Speculative decoding benchmark (issue 34): decode tok/s against acceptance on the real engine.

    python -m bench speculative                       # CPU, `small`: batch 1 at ALPHA 0.7, batch 32 at ALPHA 0, ngram
    python -m bench speculative --oracle 0.7 --batch 1 --k 4
    python -m bench speculative --oracle 0 0.5 1 --batch 1 4 --json out.json
    python -m bench speculative --batch 1 --oracle 0.7 --draft DIR   # + draft:DIR, as its acceptance comes
    python -m bench speculative --eagle3 [DIR]        # + eagle3:DIR (default: a random head for `small`)
    python -m bench speculative --batch 1 --oracle 0.7 --no-ngram --row json   # constrained rows
    python -m bench speculative --tp 2 --cpu-time --eagle3 --batch 1 --no-ngram --oracle   # under TP

``--oracle ALPHA``: the drafter proposes the target's own greedy continuation (known from a run
without speculation), each token replaced by a wrong one at rate ``1 - ALPHA``, so ALPHA sets the
acceptance rate. ``ngram`` (prompt lookup) runs on the same prompts, as its acceptance comes.
``--eagle3 DIR``: an EAGLE-3 head (``eagle3:DIR``), as its acceptance comes; with no DIR, a head
with random weights written for ``small`` (``tests/helpers/eagle3.py``): its acceptance is ~0, so
the row measures the machinery (hidden-state capture, the head's steps, K adapting down to 0),
not EAGLE-3's speedup. "rebuilt" is how many target states the head had to recompute (none here:
prefix caching is off, every token is computed by the target in this engine).

``--tp N``: the engine over N tensor-parallel ranks (rank 0 here, the others helper processes);
with ``--cpu-time`` the CPU time of the helper ranks is counted too (rank 0's alone would leave
out half the work at N = 2).

``--row`` sets what every row is: ``free`` (greedy), ``json`` (greedy under a JSON schema whose one
string is longer than the run: its drafts are cut and masked by the grammar), ``penalty``
(greedy with repetition, presence and frequency penalties) or ``logprobs`` (greedy, top-5 logprobs).
Definitions: every prompt is random token ids (``--prompt-len``), EOS disabled, greedy. Decode
tok/s = ``B * (N - 1) / (t(N) - t(1))`` (the tokens emitted after the first, where a row ends early) with the best of ``--reps`` wall times of ``generate`` for
1 and ``N`` new tokens (``t(1)`` is prefill plus the first token, which no row drafts). Every run
is checked token-identical to plain decoding. Each run sets its drafter afresh, so its rows start
with no acceptance history (``engine.spec.adaptive``: K drafts each at batch <= 4, fewer above, none at 32). "step cost" is the time of one step at ALPHA 0 (every
row verifies K drafts and emits one token) over a plain decode step: what a (K+1)-token forward
pass costs against a one-token one on this device.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

from bench.common import Benchmark, emit, parse, parser
from bench.common.models import model_dir as resolve_model
from engine.config import EngineConfig
from engine.draft_model import DraftModelDrafter
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.spec.adaptive import AcceptancePrior, DraftLength
from engine.spec.oracle import OracleDrafter
from engine.spec.registry import create_drafter
from mesh.constraints.spec import Constraint

BENCHMARK = Benchmark(
    name="speculative",
    measures="decode tok/s with speculative decoding against plain decoding on the real engine (CPU, `small`): "
             "an oracle drafter at a set acceptance, ngram, a draft model, EAGLE-3; every run token-identical",
    target=">= 1.5x plain at acceptance 0.7, batch 1; no worse than plain at acceptance 0, batch 32 (issue 34)",
    minutes=3,
    smoke=("--model", "tiny", "--batch", "1", "--oracle", "0.7", "--new-tokens", "8", "--reps", "1"),
)
BLOCK_SIZE = 16
CLOCK = [time.perf_counter]  # --cpu-time: cpu_time
RANK_PIDS: list[int] = []  # --tp: the helper ranks of the engine being measured (cpu_time counts them)
ROWS = {  # --row: the sampling parameters of every row, but max_tokens
    "free": {},
    # one JSON string that must be long: the grammar never completes within --new-tokens
    "json": {"constraint": Constraint.json_schema({"type": "object", "required": ["text"], "properties": {
        "text": {"type": "string", "minLength": 4096}}})},
    "penalty": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logprobs": {"logprobs": 5},
}


def cpu_time() -> float:
    """This process's CPU time and its helper ranks' (``/proc/PID/stat``: utime and stime)."""
    total = time.process_time()
    for pid in RANK_PIDS:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def open_engine(model_dir: Path, **kw) -> Engine:
    """An engine on the CPU in float32 (``tp`` ranks: its helpers' CPU time counted by cpu_time)."""
    engine = Engine(EngineConfig(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, **kw))
    RANK_PIDS[:] = engine.tp.pids if engine.tp else []
    return engine


def make_engine(model_dir: Path, batch: int, prompt_len: int, n: int, k: int, tp: int = 1,
                eagle3: str | None = None) -> Engine:
    """Built with ``eagle3:DIR`` when given (its drafter is then ``engine.eagle3``), else ngram."""
    blocks = batch * -(-(prompt_len + n + k + 1) // BLOCK_SIZE) + 16
    return open_engine(model_dir, num_kv_blocks=blocks, max_num_batched_tokens=max(2048, batch * prompt_len),
                       max_num_seqs=max(batch, 8), enable_prefix_caching=False, tp=tp,
                       speculative=f"eagle3:{eagle3}" if eagle3 else "ngram", num_speculative_tokens=k)


def run_once(engine: Engine, prompts: list[list[int]], n: int, drafter, row: str = "free"
             ) -> tuple[float, int, list[list[int]]]:
    """Wall time of ``generate`` for ``n`` new tokens, its step count and outputs."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **ROWS[row])
    engine.set_drafter(drafter)
    if isinstance(drafter, OracleDrafter):
        drafter.rng = random.Random(0)  # the same corruptions every time
    s0 = engine.num_steps
    t0 = CLOCK[0]()
    seqs = engine.generate(prompts, params)
    return CLOCK[0]() - t0, engine.num_steps - s0, [s.output_token_ids for s in seqs]


def measure(engine: Engine, prompts, n: int, modes: dict, reps: int, row: str) -> dict[str, dict]:
    """Every mode (name -> drafter) in turn, ``reps`` rounds (a slow spell of a shared machine hits
    all modes alike); per mode the best t(1) and t(N)."""
    best = {name: [float("inf"), float("inf")] for name in modes}
    stats: dict[str, dict] = {}
    for _ in range(reps):
        for name, drafter in modes.items():
            t1, _, _ = run_once(engine, prompts, 1, drafter, row)
            c = engine.scheduler.spec
            before = (c.drafted, c.accepted, c.emitted, c.steps)
            tn, steps, out = run_once(engine, prompts, n, drafter, row)
            drafted, accepted, emitted, rows = (a - b for a, b in zip((c.drafted, c.accepted, c.emitted, c.steps),
                                                                      before, strict=True))
            best[name] = [min(best[name][0], t1), min(best[name][1], tn)]
            stats[name] = {"steps": steps, "acceptance": accepted / drafted if drafted else None,
                           "mean_emitted_per_row_step": emitted / rows if rows else None, "out": out}
    for name, (t1, tn) in best.items():
        st = stats[name]
        st["decode_tok_s"] = sum(len(o) - 1 for o in st["out"]) / (tn - t1)
        st["decode_step_ms"] = (tn - t1) / max(1, st["steps"] - 1) * 1000  # steps after the first (prefill)
    return stats


def run_batch(model_dir: Path, batch: int, args) -> list[dict]:
    rng = random.Random(args.seed)
    engine = make_engine(model_dir, batch, args.prompt_len, args.new_tokens, args.k, args.tp, args.eagle3)
    eagle = engine.eagle3
    prompts = [[rng.randrange(8, engine.vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
    run_once(engine, prompts, 4, None, args.row)  # warm-up
    _, _, ref = run_once(engine, prompts, args.new_tokens, None, args.row)
    conts = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    modes = {"plain": None}
    modes.update({f"oracle {a:g}": OracleDrafter(conts, a, engine.vocab_size) for a in args.oracle})
    if args.ngram:
        modes["ngram"] = create_drafter("ngram")
    if args.draft:
        modes["draft"] = DraftModelDrafter(args.draft, engine.model_config, engine.device, engine.dtype,
                                           engine.pool.num_blocks, BLOCK_SIZE, "torch")
    if args.eagle3:
        modes["eagle3"] = eagle
    stats = measure(engine, prompts, args.new_tokens, modes, args.reps, args.row)
    if args.eagle3:
        stats["eagle3"]["rebuilt"] = eagle.rebuilt_tokens
    engine.close()
    plain = stats["plain"]
    rows = []
    for name, st in stats.items():
        out = st.pop("out")
        row = {"batch": batch, "tp": args.tp, "row": args.row, "method": name, "k": 0 if name == "plain" else args.k, **st,
               "identical": out == ref}
        if name != "plain":
            row["speedup"] = st["decode_tok_s"] / plain["decode_tok_s"]
        if name == "oracle 0":  # every row drafts K and emits one token: the (K+1)-token step's cost
            row["step_cost"] = st["decode_step_ms"] / plain["decode_step_ms"]
        rows.append(row)
    return rows


def run_rebuild(model_dir: Path, batch: int, args) -> dict:
    """eagle3 on prompts whose KV is cached (a second run of the same prompts, prefix caching on):
    the head's target states for the cached tokens are rebuilt (``Eagle3Drafter._rebuild``, timed
    here) where the target computes only each prompt's last token. Against the prefill of the same
    prompts (the first run's ``t(1)``), which the rebuild partly repeats (layers up to the last
    auxiliary one, no logits)."""
    rng = random.Random(args.seed + 1)
    blocks = batch * -(-(args.rebuild_len + 8 + args.k + 1) // BLOCK_SIZE) * 2 + 16
    engine = open_engine(model_dir, num_kv_blocks=blocks, max_num_batched_tokens=max(2048, batch * args.rebuild_len),
                         max_num_seqs=max(batch, 8), tp=args.tp, speculative=f"eagle3:{args.eagle3}",
                         num_speculative_tokens=args.k)
    eagle, spent = engine.eagle3, [0.0]
    rebuild = eagle._rebuild

    def timed(*a):
        t0 = CLOCK[0]()
        try:
            return rebuild(*a)
        finally:
            spent[0] += CLOCK[0]() - t0

    eagle._rebuild = timed
    prompts = [[rng.randrange(8, engine.vocab_size) for _ in range(args.rebuild_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = CLOCK[0]()
    engine.generate(prompts, params)  # cold: the prefill, nothing drafted
    prefill = CLOCK[0]() - t0
    engine.scheduler.spec_prior = AcceptancePrior()  # new rows draft at their first decode step
    t0 = CLOCK[0]()
    engine.generate(prompts, SamplingParams(max_tokens=2 + args.k, temperature=0.0, ignore_eos=True))
    warm = CLOCK[0]() - t0
    engine.close()
    return {"batch": batch, "tp": args.tp, "prompt_len": args.rebuild_len, "rebuilt": eagle.rebuilt_tokens,
            "rebuild_ms": spent[0] * 1000, "prefill_ms": prefill * 1000, "cached_run_ms": warm * 1000}


def random_head(model_dir: Path) -> Path:
    """An EAGLE-3 head with random weights for ``model_dir``, in the published format (written once)."""
    from tests.helpers.eagle3 import make_eagle3_checkpoint

    out = model_dir.parent / f"{model_dir.name}-eagle3-random"
    if not (out / "model.safetensors").is_file():
        make_eagle3_checkpoint(model_dir, out, seed=0)
    return out


def print_rows(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'row':<8} {'method':<12} {'K':>2} {'tok/s':>8} {'ms/step':>8} {'steps':>6} {'accept':>7} "
          f"{'tok/row/step':>12} {'speedup':>8} {'step cost':>9} identical")
    def f(r, key, fmt):
        v = r.get(key)
        return format(v, fmt) if v is not None else "-"

    for r in rows:
        print(f"{r['batch']:>5} {r['row']:<8} {r['method']:<12} {r['k']:>2} {r['decode_tok_s']:>8.1f} {r['decode_step_ms']:>8.2f} "
              f"{r['steps']:>6} {f(r, 'acceptance', '.2f'):>7} {f(r, 'mean_emitted_per_row_step', '.2f'):>12} "
              f"{f(r, 'speedup', '.2f'):>8} {f(r, 'step_cost', '.2f'):>9} {r['identical']}"
              + (f"  rebuilt {r['rebuilt']}" if "rebuilt" in r else ""))


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--model", help="model directory, or a generated size: tiny, small (default)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default: 1 and 32)")
    p.add_argument("--oracle", type=float, nargs="*", default=None, metavar="ALPHA",
                   help="acceptance rates of the oracle drafter (default: 0.7 at batch 1, 0 at batch 32)")
    p.add_argument("--no-ngram", dest="ngram", action="store_false", help="skip the ngram drafter")
    p.add_argument("--draft", metavar="DIR", help="also draft with this model (draft:DIR; the same tokenizer)")
    p.add_argument("--eagle3", nargs="?", const="", default=None, metavar="DIR",
                   help="also draft with this EAGLE-3 head (eagle3:DIR); no DIR: a random head for `small`")
    p.add_argument("--rebuild-len", type=int, default=512, metavar="N",
                   help="with --eagle3: time rebuilding the head's states for cached prompts of N tokens, batch 1 and 4 (0: skip)")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--row", choices=sorted(ROWS), default="free", help="what every row is (default: free)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes on this CPU)")
    p.add_argument("--fixed-k", action="store_true",
                   help="rows always draft K (no adaptation): at ALPHA 0, 'step cost' is then the raw cost of "
                        "a (K+1)-token verification step against a plain decode step")
    p.add_argument("--cpu-time", action="store_true",
                   help="one torch thread (per rank), and the CPU time of the process and its --tp ranks "
                        "instead of wall time (a loaded shared machine: wall time measures the other tenants)")
    args = parse(BENCHMARK, p, argv)
    if args.cpu_time:
        import torch

        torch.set_num_threads(1)  # the helper ranks take this rank's count over --tp: 1 too
        CLOCK[0] = cpu_time
    if args.fixed_k:  # every row starts at K and stays there
        DraftLength.update = lambda self, drafted, accepted, max_k: None
        AcceptancePrior.start = lambda self, max_k, batch: DraftLength(max_k)
    model_dir = resolve_model(args.model, "small")
    if args.eagle3 == "":
        args.eagle3 = str(random_head(model_dir))
    rows = []
    defaults = {1: [0.7], 32: [0.0]}
    for batch in args.batch or [1, 32]:
        batch_args = argparse.Namespace(**{**vars(args), "oracle": args.oracle if args.oracle is not None
                                           else defaults.get(batch, [0.0])})
        rows += run_batch(model_dir, batch, batch_args)
        print_rows(rows[-(1 + len(batch_args.oracle) + args.ngram + bool(args.draft) + bool(args.eagle3)):])
        sys.stdout.flush()
    if args.eagle3 and args.rebuild_len:
        for batch in (1, 4):  # rows start drafting at once up to 4 (engine.spec.adaptive); in larger
            r = run_rebuild(model_dir, batch, args)  # batches at their first probe, rebuilding then
            print(f"eagle3 rebuild, tp {args.tp}, batch {batch}, prompts of {r['prompt_len']}: {r['rebuilt']} target states "
                  f"rebuilt in {r['rebuild_ms']:.1f} ms; the cold prefill of the same prompts took "
                  f"{r['prefill_ms']:.1f} ms; the cached run (rebuild, 1 prefill token, {1 + args.k} more tokens) "
                  f"{r['cached_run_ms']:.1f} ms")
            rows.append({"method": "eagle3 rebuild", **r})
    emit(BENCHMARK, {"model": str(model_dir), "k": args.k, "row": args.row, "cpu_time": args.cpu_time,
                     "tp": args.tp, "rows": rows}, args)
    return 0 if all(r.get("identical", True) for r in rows) else 1
