"""KV bytes per token and per request, measured from the engine's own pools, for the published
shapes of DeepSeek-V3 (MLA: one latent vector of 512 + 64 rope values per token and layer),
Llama-3-70B and Llama-3-8B (K and V of 8 heads of 128); and the time one request's KV takes
between two processes over shm, and (``--hosts 2``, root) over nixl between two network
namespaces.

Each shape's ``config.json`` (the published values; no weights) is read by the engine's
``ModelConfig``, which gives the KV spec a worker builds its pool from; the pool is the engine's
``KVCache`` of one request's blocks, and its bytes are its tensor's, divided by the tokens it
holds. ``--kv-dtype`` takes any dtype the pool takes (bfloat16 by default; float8_e4m3fn: the
bytes of an FP8 cache, where the KV spec accepts one).

Transfers move one ``--tokens`` request (its blocks consecutive) with the mesh's senders: shm
from this process into a pool in a shared-memory file (as a prefill worker writes a decode
worker's), until the bytes are in place; nixl as ``bench transfer --hosts 2`` times it (UCX over
TCP on a veth pair, until the receiver has the PrefillDone that rides in the write's
notification). Every transfer's bytes are checked once.

    python -m bench kv-bytes [--kv-dtype bfloat16 float8_e4m3fn] [--tokens 4096] [--repeat 3]
    sudo python -m bench kv-bytes --hosts 2        # adds nixl between namespaces
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import DRY_RUN_HELP, Benchmark, emit, parse, parser

BENCHMARK = Benchmark(
    name="kv-bytes",
    measures="KV bytes per token and per 4k-token request from the engine's pools (DeepSeek-V3, Llama-3-70B, "
             "Llama-3-8B shapes; --kv-dtype), and one request's transfer time over shm (--hosts 2: nixl "
             "between network namespaces, root)",
    target="MLA >= 4x fewer bytes than the Llama-3-70B shape (issue 49)",
    minutes=1,
    smoke=("--dry-run",),
)
BS = 16
# the published configs' fields the KV spec depends on (and what ModelConfig checks beside them)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False}
SHAPES = {
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False},
    "llama-3-70b": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3-8b": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
}
BASELINE = "llama-3-70b"


def kv_spec(shape: str, num_blocks: int, dtype: torch.dtype):
    """The KV spec a worker of ``shape`` builds its pool from (``ModelConfig.kv_cache_spec``)."""
    from engine.config import ModelConfig

    with tempfile.TemporaryDirectory(prefix="kv-bytes-") as d:
        (Path(d) / "config.json").write_text(json.dumps(SHAPES[shape]))
        mc = ModelConfig.from_dir(d)
    return mc.kv_cache_spec(num_blocks, BS, dtype)


def pool_bytes(spec) -> int:
    """The bytes of the engine's pool of ``spec`` (its tensor's, allocated)."""
    from kvstore.cache import KVCache

    kv = KVCache(spec, torch.device("cpu"))
    try:
        return kv.tensor.numel() * kv.tensor.element_size()
    finally:
        kv.close()


async def shm_seconds(spec, repeat: int) -> list[float]:
    """One request's blocks from a pool here into a pool in a shared-memory file, by the shm sender:
    seconds per transfer (the first's bytes checked)."""
    from kvstore.cache import KVCache
    from kvstore.transfer import TransferTarget, host_id, make_sender
    from kvstore.transfer.shm import segment_name, shm_path

    path = shm_path(f"kv-bytes-{os.getpid()}")
    dst = KVCache(spec, torch.device("cpu"), shm_path=path)
    src = KVCache(spec, torch.device("cpu"))
    try:
        src.tensor.view(torch.uint8).random_()  # any dtype (a float8 one has no normal_)
        sender = make_sender("shm", bus=None)
        params = {"name": segment_name(path), "host": host_id(), "spec": spec.to_dict()}
        ids = list(range(spec.num_blocks))
        times = []
        for r in range(repeat):
            t0 = time.perf_counter()
            await sender.send(TransferTarget(f"kv-bytes-{r}", "kv-bytes", ids, spec.block_size), params, src, ids)
            times.append(time.perf_counter() - t0)
            if r == 0:
                assert torch.equal(dst.tensor.view(torch.uint8), src.tensor.view(torch.uint8)), "shm: the bytes differ"
        return times
    finally:
        src.close()
        dst.close(unlink=True)


def nixl_seconds(spec, repeat: int) -> list[float]:
    """One request's blocks over nixl between two network namespaces (``bench.kv.transfer_hosts``)."""
    from bench.kv import transfer_hosts

    shape = {k: v for k, v in spec.to_dict().items() if k != "num_blocks"}
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")} or {
        "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
    rows = transfer_hosts.run_hosts([], repeat, "nixl", env, shape=shape, blocks=[spec.num_blocks],
                                    transports=["nixl"])
    return rows[0]["seconds"]


def measure(args, shape: str, dtype: torch.dtype) -> dict:
    num_blocks = -(-args.tokens // BS)
    spec = kv_spec(shape, num_blocks, dtype)
    tokens = num_blocks * BS
    nbytes = spec.total_bytes if args.dry_run else pool_bytes(spec)
    row = {"shape": shape, "kv_dtype": str(dtype).removeprefix("torch."), "layers": spec.num_layers,
           "planes": spec.num_planes, "heads": spec.num_kv_heads, "head_dim": spec.head_dim,
           "block_bytes": spec.block_bytes, "bytes_per_token": nbytes / tokens, "tokens": tokens,
           "bytes_per_request": nbytes}
    if args.dry_run:
        print(f"DRY RUN: {shape} {row['kv_dtype']}: a pool of {num_blocks} blocks ({nbytes / 1e6:.1f} MB), then "
              f"{args.repeat} shm transfer(s)" + (" and nixl between namespaces" if args.hosts == 2 else ""))
        return row
    shm = asyncio.run(shm_seconds(spec, args.repeat))
    row["shm_ms"] = statistics.median(shm) * 1000
    row["shm_gbps"] = nbytes / statistics.median(shm) / 1e9
    if args.hosts == 2:
        nixl = nixl_seconds(spec, args.repeat)
        row["nixl_ms"] = statistics.median(nixl) * 1000
        row["nixl_gbps"] = nbytes / statistics.median(nixl) / 1e9
    return row


def report(rows: list[dict], tokens: int, repeat: int) -> dict:
    base = {r["kv_dtype"]: r["bytes_per_token"] for r in rows if r["shape"] == BASELINE}
    print(f"KV per token and per {tokens}-token request from the engine's pools (blocks of {BS}); transfer of "
          f"one request, median of {repeat}")
    print(f"{'shape':<12} {'dtype':<14} {'KB/token':>9} {'MB/request':>11} {'70B/this':>9} {'shm ms':>8} "
          f"{'nixl ms':>8}")
    for r in rows:
        r["fewer_than_70b"] = base[r["kv_dtype"]] / r["bytes_per_token"] if r["kv_dtype"] in base else None
        ratio = f"{r['fewer_than_70b']:.2f}" if r["fewer_than_70b"] else "-"
        print(f"{r['shape']:<12} {r['kv_dtype']:<14} {r['bytes_per_token'] / 1024:>9.1f} "
              f"{r['bytes_per_request'] / 1e6:>11.1f} {ratio:>9} {r.get('shm_ms', float('nan')):>8.1f} "
              f"{r.get('nixl_ms', float('nan')):>8.1f}")
    return {"tokens": tokens, "block_size": BS, "repeat": repeat, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = parser(BENCHMARK, __doc__)
    p.add_argument("--kv-dtype", nargs="+", default=["bfloat16"], help="the pools' dtypes (torch names)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=4096, help="one request's tokens")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: also nixl between two network namespaces (root)")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parse(BENCHMARK, p, argv)
    dtypes = []
    for name in args.kv_dtype:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            p.error(f"--kv-dtype {name}: not a torch dtype")
        dtypes.append(dtype)
    if BASELINE not in args.shapes:
        args.shapes.append(BASELINE)  # the ratio's denominator
    rows = [measure(args, shape, dtype) for dtype in dtypes for shape in args.shapes]
    return emit(BENCHMARK, report(rows, -(-args.tokens // BS) * BS, args.repeat), args)


if __name__ == "__main__":
    raise SystemExit(main())
