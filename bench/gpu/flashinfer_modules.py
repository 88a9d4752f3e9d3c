"""The FlashInfer modules the GPU check uses: which ones, how each is built, and where a lent
machine finds them built already.

FlashInfer 0.6 compiles each kernel module with nvcc on first use (a "JIT spec", named by its
variant) and loads it through TVM-FFI. The 2026-12-04 check spent 189 s of its budget on those
builds, so ``scripts/build_gpu_kernels.py`` builds them here, on a machine with nvcc and no GPU,
for sm_90a (the H100/H200), into ``gpu_kernels/`` (git-ignored), which the device call carries:

    gpu_kernels/manifest.json                    what was built: names, sizes, sha256, toolchain
    gpu_kernels/jit_cache/NAME/NAME.so           one module each
    gpu_kernels/flashinfer_jit_cache/__init__.py the finder (below)

FlashInfer loads a module without building it when it lies in its AOT directory, which is the
``flashinfer_jit_cache`` package's when one is importable (FlashInfer's own precompiled-kernel
package; ours is a three-line stand-in pointing at ``jit_cache/``). A module missing there is
JIT-built as before, so a module that is not carried, or not loadable, costs build time and
nothing else. ``verify_carried`` checks every carried module against the manifest and loads it.

This module imports no flashinfer and no torch at import time: the CPU dry run reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY_DIR = ROOT / "gpu_kernels"  # git-ignored; the device call's carry names it
FLASHINFER_VERSION = "0.6.13"
TARGET_ARCH = "9.0"  # FLASHINFER_CUDA_ARCH_LIST: sm_90a, what FlashInfer picks on an H100/H200
FINDER = '''"""Stand-in for FlashInfer's precompiled-kernel package: its AOT directory is jit_cache/ beside
this folder, for the FlashInfer the modules were built with ({version}). Under any other version
it names an empty directory instead (FlashInfer then builds every module), rather than
FlashInfer's version-mismatch error, which would stop every import of flashinfer."""
import os
from importlib import metadata

BUILT_FOR = "{version}"
try:
    _installed = metadata.version("flashinfer-python")
except metadata.PackageNotFoundError:
    _installed = BUILT_FOR
__version__ = _installed + "+pdmesh"


def get_jit_cache_dir():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "jit_cache" if _installed == BUILT_FOR else "jit_cache_for_" + _installed)
'''


@dataclass(frozen=True)
class KernelModule:
    """One FlashInfer module: ``key`` is ours, ``spec()`` FlashInfer's JIT spec (whose name is the
    module's file name). ``first``: the engine benchmark, the check's first part, needs it."""

    key: str
    what: str
    functions: tuple[str, ...]  # what FlashInfer's Python calls on the loaded module (the load check looks)
    first: bool = False
    carried: bool = True

    def spec(self):
        """FlashInfer's JitSpec (imports flashinfer; FLASHINFER_CUDA_ARCH_LIST must be set on a CPU)."""
        kind, _, variant = self.key.partition(":")
        return _SPEC_MAKERS[kind](variant)


def _attention(variant: str):
    # The arguments the engine's wrappers pass (engine/attention/flashinfer_backend.py): FA2, the
    # same dtype for q/kv/out, int32 page indices, no rope in the kernel, no window, no soft cap;
    # one module serves the paged and ragged prefill and the tensor-core decode wrappers.
    import torch
    from flashinfer.jit.attention import gen_batch_prefill_module

    dtype, head_dim = variant.split("-")
    dt = getattr(torch, dtype)
    return gen_batch_prefill_module("fa2", dt, dt, dt, torch.int32, int(head_dim), int(head_dim), 0, False, False,
                                    False)


def _norm(_):
    from flashinfer.jit.norm import gen_norm_module

    return gen_norm_module()


def _activation(variant: str):
    from flashinfer.jit.activation import gen_act_and_mul_module

    return gen_act_and_mul_module(variant)


def _rope(_):
    from flashinfer.jit.rope import gen_rope_module

    return gen_rope_module()


def _sampling(_):
    from flashinfer.jit.sampling import gen_sampling_module

    return gen_sampling_module()


def _cascade(_):
    from flashinfer.jit.cascade import gen_cascade_module

    return gen_cascade_module()


def _fused_moe(_):
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    return gen_cutlass_fused_moe_sm90_module()


_SPEC_MAKERS = {"attention": _attention, "norm": _norm, "activation": _activation, "rope": _rope,
                "sampling": _sampling, "cascade": _cascade, "fused_moe": _fused_moe}

ATTENTION_FUNCTIONS = ("plan", "paged_run", "ragged_run")
# In the order the check needs them: the engine benchmark's first.
MODULES = (
    KernelModule("attention:bfloat16-128", "FA2 attention, bf16, head_dim 128 (the engine benchmark)",
                 ATTENTION_FUNCTIONS, first=True),
    KernelModule("norm", "fused add+RMSNorm (--fused-kernels add_rmsnorm)", ("fused_add_rmsnorm",), first=True),
    KernelModule("activation:silu", "SiLU-and-mul (--fused-kernels silu_and_mul)", ("silu_and_mul",), first=True),
    KernelModule("rope", "rope in place (--fused-kernels rope)", ("apply_rope_pos_ids_cos_sin_cache",), first=True),
    KernelModule("cascade", "merge_state (flashinfer-ragged: the engine benchmark's prefill)", ("merge_state",),
                 first=True),
    KernelModule("attention:bfloat16-64", "FA2 attention, bf16, head_dim 64 (tests/gpu's small model)",
                 ATTENTION_FUNCTIONS),
    KernelModule("attention:float16-64", "FA2 attention, fp16, head_dim 64 (tests/gpu's small model)",
                 ATTENTION_FUNCTIONS),
    KernelModule("sampling", "top-k/top-p sampling (--fused-kernels sampling)",
                 ("top_k_mask_logits", "top_p_sampling_from_probs")),
    # 182 sources (154 CUTLASS instantiations): tens of minutes of nvcc even on the device's 16
    # cores, so neither carried nor built within a check (the check's opt-in moe part)
    KernelModule("fused_moe:sm90", "CUTLASS fused MoE for sm_90 (tests/gpu/test_moe_gpu.py, moe-gpu)",
                 ("init",), carried=False),
)
BY_KEY = {m.key: m for m in MODULES}


def select(keys: str) -> list[KernelModule]:
    """``all``, ``carried`` (all but those too large to carry), ``first``, or a comma list of keys."""
    if keys == "all":
        return list(MODULES)
    if keys == "carried":
        return [m for m in MODULES if m.carried]
    if keys == "first":
        return [m for m in MODULES if m.first]
    chosen = [k.strip() for k in keys.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in BY_KEY]
    if unknown:
        raise ValueError(f"unknown kernel module(s) {', '.join(unknown)} "
                         f"(choose from {', '.join(BY_KEY)}, all, carried, first)")
    return [BY_KEY[k] for k in chosen]


# -- the carried folder ----------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(carry: Path = CARRY_DIR) -> dict:
    """The manifest, with each entry's file checked: ``entries[i]["problem"]`` is None when the
    file is there with the size and sha256 the manifest gives. Raises FileNotFoundError without one."""
    manifest = json.loads((carry / "manifest.json").read_text())
    for entry in manifest["modules"]:
        path = carry / entry["file"]
        if not path.is_file():
            entry["problem"] = "file missing"
        elif path.stat().st_size != entry["bytes"]:
            entry["problem"] = f"size {path.stat().st_size}, manifest {entry['bytes']}"
        elif sha256(path) != entry["sha256"]:
            entry["problem"] = "sha256 differs from the manifest"
        else:
            entry["problem"] = None
    known = {m.key for m in MODULES}
    manifest["unknown_keys"] = [e["key"] for e in manifest["modules"] if e["key"] not in known]
    return manifest


def write_finder(carry: Path) -> None:
    finder = carry / "flashinfer_jit_cache"
    finder.mkdir(parents=True, exist_ok=True)
    (finder / "__init__.py").write_text(FINDER.format(version=FLASHINFER_VERSION))


def use_carried(carry: Path = CARRY_DIR) -> None:
    """Make this process's FlashInfer find the carried modules (before flashinfer is imported);
    the check exports the same PYTHONPATH for the processes it starts."""
    import sys

    if str(carry) not in sys.path:
        sys.path.insert(0, str(carry))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(carry), os.environ.get("PYTHONPATH")) if p)


# -- on the device -----------------------------------------------------------------------------------


def verify_carried(carry: Path, load: bool) -> dict:
    """What the carried folder holds and, with ``load``, whether FlashInfer takes each module from
    it: the JIT spec's name is the manifest's, FlashInfer sees it as prebuilt (``is_aot``) and it
    loads. A module that fails any of these is removed from the folder, so FlashInfer builds it."""
    report = {"dir": str(carry), "carried": [], "loaded": [], "failed": {}, "not_carried": []}
    try:
        manifest = read_manifest(carry)
    except FileNotFoundError:
        report["note"] = f"no {carry.name}/manifest.json: every module is built on the device"
        report["not_carried"] = [m.key for m in MODULES]
        return report
    report["toolchain"] = manifest.get("toolchain")
    if load:
        report["installed"] = installed = _installed_versions()
        built = {k: (manifest.get("toolchain") or {}).get(k) for k in installed}
        if built != installed:
            # another FlashInfer: the finder points it elsewhere and every module builds; another
            # tvm-ffi: each module is still loaded, and one that fails builds
            report["note"] = (f"built for {built}, installed {installed}" + (
                ": FlashInfer builds every module" if built["flashinfer"] != installed["flashinfer"] else ""))
    entries = {e["key"]: e for e in manifest["modules"]}
    report["carried"] = list(entries)
    report["not_carried"] = [m.key for m in MODULES if m.key not in entries]
    for key in manifest["unknown_keys"]:
        report["failed"][key] = "not a module the check uses (bench/gpu/flashinfer_modules.py)"
    for key, entry in entries.items():
        if key in report["failed"]:
            continue
        if entry["problem"]:
            report["failed"][key] = entry["problem"]
        elif load:
            problem = _load_problem(BY_KEY[key], entry)
            if problem is None:
                report["loaded"].append(key)
            else:
                report["failed"][key] = problem
        if key in report["failed"] and load:
            (carry / entry["file"]).unlink(missing_ok=True)  # FlashInfer then builds it
    return report


def _installed_versions() -> dict:
    from importlib import metadata

    found = {}
    for key, dist in (("flashinfer", "flashinfer-python"), ("apache_tvm_ffi", "apache-tvm-ffi")):
        try:
            found[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[key] = None
    return found


def _load_problem(module: KernelModule, entry: dict) -> str | None:
    try:
        spec = module.spec()
        if spec.name != entry["name"]:
            return f"FlashInfer names this variant {spec.name}, the manifest {entry['name']}"
        if not spec.is_aot:
            return f"FlashInfer does not look for it there (its AOT directory: {spec.aot_path.parent.parent})"
        spec.build_and_load()  # prebuilt: loads it, builds nothing
    except Exception as e:  # any failure means: build it instead, and say why
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def build_modules(modules: list[KernelModule]) -> dict:
    """Load each module, building those FlashInfer cannot find prebuilt (the carried ones load)."""
    report = {"built": {}, "prebuilt": [], "failed": {}}
    for module in modules:
        t0 = time.time()
        try:
            spec = module.spec()
            prebuilt = spec.is_aot or spec.is_compiled
            spec.build_and_load()
        except Exception as e:  # named in the report; the next module still builds
            report["failed"][module.key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if prebuilt:
            report["prebuilt"].append(module.key)
        else:
            report["built"][module.key] = round(time.time() - t0, 1)
        print(f"flashinfer {module.key}: {'ready' if prebuilt else 'built'} in {time.time() - t0:.0f}s", flush=True)
    return report


def cli(argv: list[str] | None = None) -> int:  # not ``main``: that names a benchmark
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m bench.gpu.flashinfer_modules",
                                description="the GPU check's FlashInfer modules: verify the carried ones, build the rest")
    p.add_argument("action", choices=("verify", "build"))
    p.add_argument("--dir", type=Path, default=Path(os.environ.get("GPU_KERNELS_DIR", CARRY_DIR)))
    p.add_argument("--no-load", action="store_true", help="verify: check the files only (no flashinfer, no GPU)")
    p.add_argument("--modules", default="all", help="build: all, first, or keys (carried ones just load)")
    p.add_argument("--json", type=Path, help="write the report here too")
    args = p.parse_args(argv)
    try:
        chosen = select(args.modules)
    except ValueError as e:
        sys.exit(f"python -m bench.gpu.flashinfer_modules: {e}")
    if args.dir.is_dir():
        use_carried(args.dir)
    if args.action == "verify":
        report = verify_carried(args.dir, load=not args.no_load)
    else:
        report = build_modules(chosen)
    text = json.dumps(report)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(cli())
