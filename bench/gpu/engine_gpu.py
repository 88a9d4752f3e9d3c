"""The GPU engine benchmark: issue 21's table in one run.

    python -m bench engine-gpu                 # CUDA: ~4 min on an H200 once FlashInfer's kernels are built
    python -m bench engine-gpu --dry-run       # the same code on the CPU with a tiny shape (plumbing only)
    bash bench/gpu_check.sh                    # builds the kernels, runs tests/gpu, then this

A Llama-3-8B-shaped model with random bf16 weights, one engine (one copy of the weights)
switched between execution modes with ``Engine.set_execution``:

    eager                  every kernel launched from Python, plain PyTorch ops, no overlap
    graphs                 decode steps replay CUDA graphs
    graphs+overlap         ... and the host schedules step N+1 while the GPU runs step N
    graphs+overlap+fused   ... and FlashInfer's fused add+RMSNorm, SiLU-and-mul and rope

Cases, each mode (the baseline, eager, is measured in the same run on the same GPU):

* decode, prompt 512, batch 1 / 64 / 256: ms per step = the median gap between consecutive
  steps that decode the whole batch (and nothing else), best of ``--reps`` runs; tok/s =
  batch / step; "of roofline" = the step the bytes allow (every weight once, the embedding
  rows of the batch, the KV of every sequence at its median context, over ``--hbm-tbps``)
  divided by the measured step;
* profile (``--gpu-profile STEPS``): torch.profiler over STEPS decode steps at batch 64 (else
  the middle batch), each mode: GPU kernel time per step against the wall time per step (the
  difference is the host gap, launches and Python, that graphs and overlap exist to close),
  launches and the host time in them, and the top kernels (``step_profile``);
* prefill, batch 8, prompts of 2k and 8k tokens, eager, per attention backend (``flashinfer``
  pages everything, ``flashinfer-ragged`` attends over the step's own K/V as a ragged batch):
  TTFT = the wall time until every request has its first token (their mean beside it),
  prompt tok/s = prompt tokens / that time. Steps take ``--gpu-max-batched-tokens`` (16384)
  tokens, so an 8k batch prefills in chunks, as a serving engine does.

``--dry-run`` runs the same code on the CPU with a tiny model shape (torch attention; the
graph and fused modes are reported as not available there): it checks the plumbing and the
table, never the hardware.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import Benchmark, emit, parse, parser
from bench.gpu.engine_gpu_tables import DecodeRow, PrefillRow, print_report
from bench.gpu.step_profile import StepProfile, print_profiles, profile_decode
from engine import engine as engine_module
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.loader import build_model
from engine.sampling import SamplingParams

BENCHMARK = Benchmark(
    name="engine-gpu",
    measures="decode ms/step and tok/s against the HBM roofline at batch 1/64/256 (Llama-3-8B shape, random bf16), "
             "eager vs CUDA graphs vs overlap vs fused kernels, and prefill TTFT at 2k/8k (CUDA)",
    target="decode >= 60% of the HBM roofline at batch 1/64/256 (issue 21)",
    minutes=4,
    smoke=("--dry-run", "--gpu-batches", "1,4", "--gpu-profile", "2"),
)
BLOCK_SIZE = 16

LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192 + 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DRY_RUN_SHAPE = {**LLAMA3_8B_SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                 "max_position_embeddings": 1024, "torch_dtype": "float32"}


@dataclass(frozen=True)
class Mode:
    name: str
    cuda_graphs: bool
    async_scheduling: bool
    fused_kernels: tuple[str, ...] = ()


MODES = {m.name: m for m in (
    Mode("eager", False, False),
    Mode("graphs", True, False),
    Mode("graphs+overlap", True, True),
    Mode("graphs+overlap+fused", True, True, ("add_rmsnorm", "silu_and_mul", "rope")),
    Mode("overlap", False, True),  # not in the default list: overlap without graphs
)}
DEFAULT_MODES = "eager,graphs,graphs+overlap,graphs+overlap+fused"


# -- the engine ---------------------------------------------------------------------------------


@contextlib.contextmanager
def random_weights(seed: int = 0):
    """Let ``Engine`` build a model with random weights on its device instead of reading safetensors
    (vLLM's ``load_format="dummy"``): swaps the loader its module calls for the duration."""

    def load_random(cfg: ModelConfig, device, dtype, max_positions, **kwargs):
        model = build_model(cfg, device, dtype, max_positions, **kwargs)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif p.dim() == 1:
                    p.zero_()
                else:  # 1/sqrt(fan_in) keeps activations O(1), so bf16 neither overflows nor NaNs
                    std = 0.2 if name.startswith("embed_tokens") else p.shape[1] ** -0.5
                    p.normal_(0.0, std, generator=gen)
        return model

    original = engine_module.load_model
    engine_module.load_model = load_random
    try:
        yield
    finally:
        engine_module.load_model = original


def build_engine(args: argparse.Namespace, shape: dict, device: torch.device) -> Engine:
    batches = args.batches
    longest = max(args.prefill_lens)
    blocks = max(max(batches) * -(-(args.prompt + args.new_tokens) // BLOCK_SIZE),
                 args.prefill_batch * -(-(longest + 1) // BLOCK_SIZE)) + 16
    model_dir = Path(tempfile.mkdtemp(prefix="pdmesh-random-model-"))
    (model_dir / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    cuda = device.type == "cuda"
    with random_weights(args.seed):
        return Engine(EngineConfig(
            model_dir, device=str(device), dtype="bfloat16" if cuda else "float32", block_size=BLOCK_SIZE,
            num_kv_blocks=blocks, max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=max(batches),
            max_model_len=longest + BLOCK_SIZE, enable_prefix_caching=False,  # repeated prompts must prefill
            attention_backend=args.attention if cuda else "torch", cuda_graphs=cuda, async_scheduling=False,
        ))


# -- measuring ---------------------------------------------------------------------------------


class StepLog:
    """(tokens scheduled, wall time when ``step()`` returned) for every step of the engine."""

    def __init__(self, engine: Engine):
        self.entries: list[tuple[int, float]] = []
        scheduler = engine.scheduler
        schedule = scheduler.schedule
        self._last = 0

        def logged():
            out = schedule()
            self._last = out.num_tokens
            return out

        scheduler.schedule = logged
        step = engine.step

        def timed_step():
            outs = step()
            self.entries.append((self._last, time.perf_counter()))
            return outs

        engine.step = timed_step

    def decode_gaps(self, batch: int) -> list[float]:
        """Gaps between consecutive steps that each decoded the whole batch and nothing else."""
        e = self.entries
        return [t1 - t0 for (n0, t0), (n1, t1) in itertools.pairwise(e) if n0 == n1 == batch]


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(batch)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def measure_decode(engine: Engine, log: StepLog, mode: str, batch: int, args, hbm_tbps: float) -> DecodeRow:
    vocab = engine.model_config.vocab_size
    engine.generate(prompts_for(batch, 16, vocab, args.seed), greedy(3))  # warm-up: graph of this size, JIT
    prompts = prompts_for(batch, args.prompt, vocab, args.seed + batch)
    steps = []
    for _ in range(args.reps):
        log.entries.clear()
        engine.generate(prompts, greedy(args.new_tokens))
        gaps = log.decode_gaps(batch)[2:-2] or log.decode_gaps(batch)  # steady state: drop the ends
        if not gaps:  # the 2026-12-04 H200 run of this mode found none: say what the steps were
            sizes = collections.Counter(n for n, _ in log.entries).most_common(6)
            raise RuntimeError(f"no two consecutive steps decoded exactly the batch of {batch}; "
                               f"{len(log.entries)} steps logged, (tokens, steps): {sizes}")
        steps.append(statistics.median(gaps))
    step = min(steps)
    roof_ms, achieved = roofline(engine, batch, args.prompt + args.new_tokens // 2, step, hbm_tbps)
    return DecodeRow(mode, batch, args.prompt, args.new_tokens, step * 1e3, batch / step, roof_ms,
                     roof_ms / (step * 1e3), achieved)


def measure_prefill(engine: Engine, attention: str, batch: int, length: int, args) -> PrefillRow:
    vocab = engine.model_config.vocab_size
    engine.generate(prompts_for(batch, min(length, 256), vocab, args.seed), greedy(1))  # warm-up
    best = None
    for rep in range(args.reps):
        prompts = prompts_for(batch, length, vocab, args.seed + 7 * rep + length)
        seqs = [engine.new_sequence(p, greedy(1)) for p in prompts]
        first: dict[str, float] = {}
        t0 = time.perf_counter()
        for s in seqs:
            engine.add(s)
        while len(first) < batch:
            for out in engine.step():
                first.setdefault(out.request_id, time.perf_counter() - t0)
        if engine.overlap is not None:
            engine.overlap.finish()
        ttft = max(first.values())
        if best is None or ttft < best[0]:
            best = (ttft, statistics.mean(first.values()))
    ttft, mean = best
    return PrefillRow(attention, batch, length, ttft * 1e3, mean * 1e3, batch * length / ttft)


def profile_mode(engine: Engine, mode: str, batch: int, args) -> StepProfile:
    """torch.profiler over ``--gpu-profile`` decode steps of ``batch`` sequences (``step_profile``)."""
    steps = args.gpu_profile
    vocab = engine.model_config.vocab_size
    seqs = [engine.new_sequence(p, greedy(steps + 8)) for p in prompts_for(batch, args.prompt, vocab, args.seed)]
    for s in seqs:
        engine.add(s)
    while any(s.num_output_tokens < 2 for s in seqs):  # prefill, first decodes (and captures) outside
        engine.step()
    try:
        return profile_decode(engine, seqs, mode, steps)
    finally:
        for s in seqs:
            engine.abort(s.request_id)
        if engine.overlap is not None:
            engine.overlap.finish()


def profile_batch(batches: list[int]) -> int:
    """The batch each mode's profile runs: the issue's batch 64 when measured, else the middle one."""
    return 64 if 64 in batches else sorted(batches)[len(batches) // 2]


def weight_bytes_per_step(model: torch.nn.Module, batch: int) -> int:
    """Every weight is read once per decode step, except the embedding table (one row per token)."""
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = p.numel() * p.element_size()
        if name.startswith("embed_tokens") and not model.cfg.tie_word_embeddings:
            nbytes = batch * p.shape[1] * p.element_size()
        total += nbytes
    return total


def roofline(engine: Engine, batch: int, context: int, step_s: float, hbm_tbps: float) -> tuple[float, float]:
    """(the step in ms the bytes allow at ``hbm_tbps``, the achieved TB/s of a ``step_s`` step)."""
    mc = engine.model_config
    elem = torch.empty((), dtype=engine.dtype).element_size()
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem  # K and V, all layers
    nbytes = weight_bytes_per_step(engine.model, batch) + batch * context * kv_token
    return nbytes / (hbm_tbps * 1e12) * 1e3, nbytes / step_s / 1e12


# -- the run -----------------------------------------------------------------------------------


def run_gpu(args: argparse.Namespace) -> dict:
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit(f"python -m bench engine-gpu: CUDA is not available here (torch {torch.__version__}); "
                 "--dry-run runs the plumbing on the CPU")
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(1)  # a tiny model: more threads only contend
    shape = DRY_RUN_SHAPE if dry else LLAMA3_8B_SHAPE
    try:
        engine = build_engine(args, shape, device)
    except (ValueError, ImportError, RuntimeError) as e:
        sys.exit(f"python -m bench engine-gpu: the engine did not start: {str(e).splitlines()[0] if str(e) else e!r}")
    log = StepLog(engine)
    decode, skipped, profiles = [], [], []
    for name in args.modes:
        mode = MODES[name]
        try:
            engine.set_execution(cuda_graphs=mode.cuda_graphs, async_scheduling=mode.async_scheduling,
                                 fused_kernels=mode.fused_kernels)
        except (ValueError, ImportError) as e:  # graphs or fused kernels where they cannot run
            skipped.append(f"{name}: {e}")
            continue
        rows = []
        for b in args.batches:
            try:
                rows.append(measure_decode(engine, log, name, b, args, args.hbm_tbps))
            except RuntimeError as e:  # named in the report; the other modes and prefill still run
                skipped.append(f"{name} batch {b}: {e}")
        if not rows:
            continue
        if args.gpu_profile:
            row = next((r for r in rows if r.batch == profile_batch(args.batches)), rows[0])
            prof = profile_mode(engine, name, row.batch, args)
            row.kernel_ms, row.launches = prof.kernel_ms, prof.launches
            profiles.append(prof)
        decode += rows
        print(f"  measured {name}: " + ", ".join(f"batch {r.batch} {r.step_ms:.2f} ms/step" for r in rows),
              file=sys.stderr)
        write_partial(args, decode, profiles, skipped)
    engine.set_execution(cuda_graphs=False, async_scheduling=False, fused_kernels=())
    prefill = []
    for attention in args.prefill_attention if not dry else ["torch"]:
        try:
            engine.set_execution(attention_backend=attention)
        except (ValueError, ImportError) as e:
            skipped.append(f"prefill {attention}: {e}")
            continue
        prefill += [measure_prefill(engine, attention, args.prefill_batch, n, args) for n in args.prefill_lens]
    header = describe(engine, args, dry)
    print_report(header, decode, prefill, skipped, args)
    print_profiles(profiles)
    return {"mode": "gpu-dry-run" if dry else "gpu", "device": header, "hbm_tb_s": args.hbm_tbps,
            "decode": [asdict(r) for r in decode], "prefill": [asdict(r) for r in prefill], "skipped": skipped,
            "profiles": [p.as_dict() for p in profiles]}


def write_partial(args, decode: list[DecodeRow], profiles: list[StepProfile], skipped: list[str]) -> None:
    """The modes measured so far, to ``--json`` (marked partial), so a run cut off by the check's
    deadline still returns them; the complete result object replaces it at the end."""
    if not args.json:
        return
    Path(args.json).write_text(json.dumps({"partial": True, "figures": {
        "decode": [asdict(r) for r in decode], "profiles": [p.as_dict() for p in profiles], "skipped": skipped}}))


def describe(engine: Engine, args, dry: bool) -> str:
    if dry:
        return f"DRY RUN on CPU (tiny shape, torch attention), torch {torch.__version__}: plumbing only"
    try:
        import flashinfer
        fi = f", flashinfer {flashinfer.__version__}"
    except ImportError:
        fi = ""
    return (f"Llama-3-8B shape, random bf16 weights, {torch.cuda.get_device_name()} ({args.hbm_tbps} TB/s HBM), "
            f"torch {torch.__version__}{fi}, decode attention {engine.config.attention_backend}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="shorter prompts and runs")
    p.add_argument("--reps", type=int, default=None, help="timed runs per measurement (best kept; default 2)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("the GPU cases (the names of issue 21's check: bench/gpu_check.sh passes them)")
    g.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny shape (plumbing only)")
    g.add_argument("--gpu-modes", default=DEFAULT_MODES, help=f"comma-separated, from {', '.join(MODES)}")
    g.add_argument("--gpu-attention", default="flashinfer", help="attention backend of the decode cases")
    g.add_argument("--gpu-batches", default="1,64,256", help="decode batch sizes")
    g.add_argument("--gpu-prompt", type=int, default=512)
    g.add_argument("--gpu-new-tokens", type=int, default=128)
    g.add_argument("--gpu-prefill-batch", type=int, default=8)
    g.add_argument("--gpu-prefill-lens", default="2048,8192")
    g.add_argument("--gpu-prefill-attention", default="flashinfer,flashinfer-ragged")
    g.add_argument("--gpu-max-batched-tokens", type=int, default=16384, help="tokens per engine step")
    g.add_argument("--gpu-profile", type=int, default=8, metavar="STEPS",
                   help="profile this many decode steps per mode (0: off): kernel time vs wall time")
    g.add_argument("--hbm-tbps", type=float, default=4.8, help="peak HBM bandwidth (H200: 4.8)")


def gpu_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the comma lists; the dry run shrinks every size to a tiny model's."""
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    modes = [m.strip() for m in args.gpu_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"python -m bench engine-gpu: unknown --gpu-modes {', '.join(unknown)} (choose from {', '.join(MODES)})")
    s = argparse.Namespace(
        dry_run=args.dry_run, modes=modes, attention=args.gpu_attention, batches=ints(args.gpu_batches),
        prompt=args.gpu_prompt, new_tokens=args.gpu_new_tokens, prefill_batch=args.gpu_prefill_batch,
        prefill_lens=ints(args.gpu_prefill_lens),
        prefill_attention=[a.strip() for a in args.gpu_prefill_attention.split(",") if a.strip()],
        max_batched_tokens=args.gpu_max_batched_tokens, gpu_profile=args.gpu_profile, hbm_tbps=args.hbm_tbps,
        reps=args.reps or 2, seed=args.seed, json=getattr(args, "json", None),
    )
    if args.quick or args.dry_run:
        s.batches = [min(b, 8) for b in s.batches] if args.dry_run else s.batches
        s.prompt, s.new_tokens = (32, 8) if args.dry_run else (128, 32)
        s.prefill_lens = [64, 128] if args.dry_run else [512, 2048]
        s.prefill_batch = min(s.prefill_batch, 2) if args.dry_run else s.prefill_batch
        s.gpu_profile = min(s.gpu_profile, 3)
        s.reps = 1 if args.reps is None else s.reps
        s.max_batched_tokens = min(s.max_batched_tokens, 256) if args.dry_run else s.max_batched_tokens
    if args.dry_run:  # overlap runs on the CPU too; the graph and fused modes are reported as not run
        s.modes = list(dict.fromkeys(["eager", "overlap", *s.modes]))
    s.batches = list(dict.fromkeys(s.batches))
    return s


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    add_arguments(p)
    args = parse(BENCHMARK, p, argv)
    return emit(BENCHMARK, run_gpu(gpu_settings(args)), args)
