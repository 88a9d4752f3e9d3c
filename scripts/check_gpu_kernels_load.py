"""Check the carried FlashInfer modules as far as a machine without a GPU can, in two ways:

    build/tvm-ffi-py312/bin/python scripts/check_gpu_kernels_load.py load       # Python 3.12, tvm-ffi only
    PYTHONPATH=build/flashinfer-site .venv/bin/python scripts/check_gpu_kernels_load.py lookup

``load``: under the device's Python (3.12, with the apache-tvm-ffi wheel it installs; the modules
are built under another), each file is checked against the manifest, loaded with
``tvm_ffi.load_module`` (a dlopen: its libraries and symbols resolve, a link-time stand-in for
the CUDA driver taking the driver's place) and asked for the functions FlashInfer's Python calls.

``lookup``: FlashInfer itself, called as the engine calls it (the wrappers and arguments of
engine/attention/flashinfer_backend.py and flashinfer_ragged.py, the kernels of engine/kernels.py),
asks for exactly the modules the manifest holds, and finds each one prebuilt in gpu_kernels/
(its AOT path: no build). The calls stop where FlashInfer would load the module; the tensors
are on the CPU, so nothing runs.

What neither can show: that the kernels run, and run right, on the GPU.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import flashinfer_modules as fm  # noqa: E402


def check_load(carry: Path) -> int:
    import tvm_ffi

    manifest = fm.read_manifest(carry)
    print(f"python {platform.python_version()}, apache-tvm-ffi {tvm_ffi.__version__}; modules built with "
          f"{json.dumps(manifest['toolchain'])}")
    bad = 0
    for entry in manifest["modules"]:
        module = fm.BY_KEY.get(entry["key"])
        if entry["problem"] or module is None:
            print(f"FAIL {entry['key']}: {entry['problem'] or 'unknown key'}")
            bad += 1
            continue
        try:
            loaded = tvm_ffi.load_module(str(carry / entry["file"]))
            missing = [f for f in module.functions if not loaded.implements_function(f)]
        except Exception as e:  # a load that fails here fails on the device too: say why
            print(f"FAIL {entry['key']}: {type(e).__name__}: {e}")
            bad += 1
            continue
        if missing:
            print(f"FAIL {entry['key']}: loads, but has no {', '.join(missing)}")
            bad += 1
        else:
            print(f"ok   {entry['key']}: {entry['name']}.so loads, has {', '.join(module.functions)}")
    print(f"{len(manifest['modules']) - bad} of {len(manifest['modules'])} carried modules load under Python "
          f"{platform.python_version()}")
    return 1 if bad else 0


class _Asked(Exception):
    pass


def engine_calls(torch, flashinfer) -> dict[str, object]:
    """The engine's FlashInfer calls, one per module variant, on tiny CPU tensors."""
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    calls = {}
    for dtype_name, head_dim in (("bfloat16", 128), ("bfloat16", 64), ("float16", 64)):
        dt, key = getattr(torch, dtype_name), f"attention:{dtype_name}-{head_dim}"
        plan = dict(q_data_type=dt, kv_data_type=dt, sm_scale=head_dim**-0.5)
        # flashinfer_backend._plan_wrapper / _plan_decode and plan_graph, flashinfer_ragged._plan_wrapper
        calls[f"{key} paged prefill"] = (key, lambda p=plan, h=head_dim: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", backend="fa2").plan(i32([0, 2]), i32([0, 1]), i32([0]), i32([2]), 8, 2, h, 16, causal=True, **p))
        calls[f"{key} decode"] = (key, lambda p=plan, h=head_dim: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True, backend="fa2").plan(i32([0, 1]), i32([0]), i32([2]), 8, 2, h, 16, **p))
        calls[f"{key} decode graph"] = (key, lambda p=plan, h=head_dim: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=i32([0, 0]),
            paged_kv_indices_buffer=i32([0, 0]), paged_kv_last_page_len_buffer=i32([0]), backend="fa2",
        ).plan(i32([0, 1]), i32([0]), i32([2]), 8, 2, h, 16, **p))
        calls[f"{key} ragged prefill"] = (key, lambda p=plan, h=head_dim: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            ws, "NHD", backend="fa2").plan(i32([0, 2]), i32([0, 2]), 8, 2, h, causal=True, **p))
    bf = torch.bfloat16
    x, lse = torch.zeros(2, 4, 64, dtype=bf), torch.zeros(2, 4)
    calls["merge_state"] = ("cascade", lambda: flashinfer.merge_state(x, lse, x, lse))
    # engine/kernels.py
    calls["fused_add_rmsnorm"] = ("norm", lambda: flashinfer.norm.fused_add_rmsnorm(
        torch.zeros(2, 64, dtype=bf), torch.zeros(2, 64, dtype=bf), torch.ones(64, dtype=bf), 1e-5))
    calls["silu_and_mul"] = ("activation:silu", lambda: flashinfer.activation.silu_and_mul(torch.zeros(2, 128, dtype=bf)))
    calls["rope"] = ("rope", lambda: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        torch.arange(2), torch.zeros(2, 4, 64, dtype=bf), torch.zeros(2, 2, 64, dtype=bf), 64, torch.zeros(16, 64),
        is_neox=True))
    calls["top_k_top_p"] = ("sampling", lambda: flashinfer.sampling.top_k_top_p_sampling_from_logits(
        torch.zeros(2, 100), torch.full((2,), 5, dtype=torch.int32), torch.full((2,), 0.9),
        filter_apply_order="top_k_first", deterministic=True, generator=torch.Generator()))
    return calls


def check_lookup(carry: Path) -> int:
    fm.use_carried(carry)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", fm.TARGET_ARCH)
    import torch

    real_empty = torch.empty

    def empty(*args, **kwargs):  # the wrappers pin their host buffers: no pinned memory without a GPU
        kwargs.pop("pin_memory", None)
        return real_empty(*args, **kwargs)

    torch.empty = empty
    import flashinfer
    from flashinfer.jit.core import JitSpec

    def asked(spec):
        raise _Asked(spec)

    JitSpec.build_and_load = asked
    manifest = fm.read_manifest(carry)
    names = {e["key"]: e["name"] for e in manifest["modules"]}
    bad = 0
    for label, (key, call) in engine_calls(torch, flashinfer).items():
        if key not in names:
            print(f"--   {label}: {key} not carried (the device builds it)")
            continue
        try:
            call()
            problem = "asked for no module"
        except _Asked as a:
            spec = a.args[0]
            if spec.name != names[key]:
                problem = f"asks for {spec.name}, the manifest has {names[key]}"
            elif not spec.is_aot:
                problem = f"{spec.name} not found prebuilt (FlashInfer looks in {spec.aot_path.parent.parent})"
            else:
                problem = None
        except Exception as e:  # the call broke before asking: the check cannot say
            problem = f"{type(e).__name__}: {e}"
        print(f"{'FAIL' if problem else 'ok  '} {label}: {problem or f'{names[key]} (prebuilt, in the manifest)'}")
        bad += bool(problem)
    print(f"flashinfer {flashinfer.__version__}: " + (f"{bad} engine call(s) failed" if bad else
          f"every engine call whose module is carried finds it prebuilt in {carry}"))
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("load", "lookup"):
        print("usage: scripts/check_gpu_kernels_load.py load|lookup [GPU_KERNELS_DIR]", file=sys.stderr)
        return 2
    carry = Path(argv[1]) if len(argv) > 1 else fm.CARRY_DIR
    try:
        return (check_load if argv[0] == "load" else check_lookup)(carry)
    except FileNotFoundError as e:
        print(f"scripts/check_gpu_kernels_load.py: {e} (scripts/build_gpu_kernels.py makes it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
