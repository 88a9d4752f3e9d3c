"""Build the FlashInfer modules the GPU check uses, here (nvcc, no GPU), for sm_90a, into
gpu_kernels/ for the device call to carry (bench/gpu/flashinfer_modules.py says how they are found).

    scripts/prepare_gpu_carry.sh        # everything a device call carries (wheels too), this included
    PYTHONPATH=build/flashinfer-site .venv/bin/python scripts/build_gpu_kernels.py [--modules carried|first|KEY,...]

It runs where flashinfer-python and apache-tvm-ffi (the versions the wheels bring to the device)
import beside a CPU torch (FlashInfer imports it; the modules do not link it).
CUDA_HOME (default /usr/local/cuda) must hold nvcc 13 and its headers; where it lacks the
driver's link stub or the cuBLAS/cuRAND headers (a toolkit from the package index), they are
made or fetched into build/. A module already in
gpu_kernels/ with the same toolchain is kept (--rebuild builds it again). Each build's time,
the .so's size and sha256 go to gpu_kernels/manifest.json. --max-bytes leaves out what would
take the folder past that size (the check builds those on the device, in the background).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import flashinfer_modules as fm  # noqa: E402


def toolchain(cuda_home: str) -> dict:
    import flashinfer
    import tvm_ffi

    nvcc = subprocess.run([f"{cuda_home}/bin/nvcc", "--version"], capture_output=True, text=True, check=True)
    return {"flashinfer": flashinfer.__version__, "apache_tvm_ffi": tvm_ffi.__version__,
            "nvcc": nvcc.stdout.strip().splitlines()[-1], "arch": fm.TARGET_ARCH + "a",
            "built_with_python": platform.python_version(), "machine": platform.machine()}


def driver_stub(cuda_home: str) -> Path | None:
    """A folder with a link-time stand-in for the CUDA driver library, where the toolkit has none.

    FlashInfer links every module with ``-lcuda``. A toolkit installed from the package index (as
    here) has no ``lib64/stubs/libcuda.so``, and only a GPU machine has the driver; so this makes
    one: every ``cu*`` name of ``cuda.h`` as an empty function, under the driver's soname
    ``libcuda.so.1``. A module linked against it needs ``libcuda.so.1``, as one linked on the
    device does, and its driver calls resolve to the real driver there. Never loaded here.
    """
    if Path(cuda_home, "lib64", "stubs", "libcuda.so").exists():
        return None
    stub_dir = ROOT / "build" / "cuda-driver-stub"
    lib = stub_dir / "libcuda.so"
    if lib.exists():
        return stub_dir
    names = sorted(set(re.findall(r"\b(cu[A-Z]\w*)\b", Path(cuda_home, "include", "cuda.h").read_text())))
    stub_dir.mkdir(parents=True, exist_ok=True)
    source = stub_dir / "libcuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in names))
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(source)], check=True)
    return stub_dir


# Headers some modules include that a toolkit from the package index keeps in other packages
# (norm: cublasLt.h; sampling: curand_kernel.h): CUDA 13.0's releases of those packages.
HEADER_PACKAGES = {"cublasLt.h": "nvidia-cublas==13.0.0.19", "curand_kernel.h": "nvidia-curand==10.4.0.35"}


def extra_headers(cuda_home: str) -> Path | None:
    """A folder with the headers ``HEADER_PACKAGES`` names, where the toolkit lacks them (fetched
    once with pip: only their include/ is kept)."""
    missing = {h: pkg for h, pkg in HEADER_PACKAGES.items() if not Path(cuda_home, "include", h).exists()}
    if not missing:
        return None
    include = ROOT / "build" / "cuda-extra-include"
    wanted = {h: pkg for h, pkg in missing.items() if not (include / h).exists()}
    if wanted:
        import zipfile

        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--platform", "manylinux_2_27_x86_64", "-d", tmp, *sorted(set(wanted.values()))],
                           check=True)
            include.mkdir(parents=True, exist_ok=True)
            for wheel in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as z:
                    for name in z.namelist():
                        if "/include/" in name and not name.endswith("/"):
                            target = include / name.split("/include/", 1)[1]
                            target.parent.mkdir(parents=True, exist_ok=True)
                            target.write_bytes(z.read(name))
    return include


def build_one(module: fm.KernelModule, out: Path, headers: Path | None) -> dict:
    # the extra headers only where a module includes them: a flag changed on a module already
    # built makes ninja compile it all again (attention includes neither)
    flags = f"-isystem {headers}" if headers is not None and not module.key.startswith("attention") else ""
    for var in ("FLASHINFER_EXTRA_CUDAFLAGS", "FLASHINFER_EXTRA_CFLAGS"):
        os.environ[var] = flags
    spec = module.spec()
    t0 = time.time()
    spec.build(verbose=False)
    seconds = time.time() - t0
    rel = Path("jit_cache") / spec.name / f"{spec.name}.so"
    dest = out / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(spec.jit_library_path, dest)
    # the host symbols' debug sections are dead weight on the device; the fatbin stays
    subprocess.run(["strip", "--strip-debug", str(dest)], check=True)
    return {"key": module.key, "name": spec.name, "what": module.what, "first": module.first, "file": str(rel),
            "bytes": dest.stat().st_size, "sha256": fm.sha256(dest), "build_seconds": round(seconds, 1),
            "needs": needs(dest)}


def needs(so: Path) -> dict:
    """What the module asks of the machine that loads it: its libraries, and the newest glibc and
    libstdc++ symbol versions it uses (the device's must be as new)."""
    dynamic = subprocess.run(["objdump", "-p", "-T", str(so)], capture_output=True, text=True).stdout
    newest = {}
    for lib, version in re.findall(r"\b(GLIBC|GLIBCXX)_(\d+(?:\.\d+)*)\b", dynamic):
        if tuple(map(int, version.split("."))) > tuple(map(int, newest.get(lib, "0").split("."))):
            newest[lib] = version
    return {"libraries": re.findall(r"NEEDED\s+(\S+)", dynamic), **newest}


def write_manifest(path: Path, tools: dict, entries: list[dict], kept: dict, chosen: list, left_out: list[str],
                   out: Path) -> None:
    # modules built before and not asked for this time stay listed
    asked = {m.key for m in chosen}
    earlier = [e for k, e in kept.items() if k not in asked and (out / e["file"]).is_file()]
    manifest = {"toolchain": tools, "modules": entries + earlier, "left_out": left_out,
                "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/build_gpu_kernels.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", default="carried",
                   help="carried (all but MoE), all, first, or a comma list of keys: " + ", ".join(fm.BY_KEY))
    p.add_argument("--out", type=Path, default=fm.CARRY_DIR)
    p.add_argument("--rebuild", action="store_true", help="build again what the manifest already has")
    p.add_argument("--max-bytes", type=int, default=None, help="leave out modules that would pass this total")
    args = p.parse_args(argv)
    try:
        chosen = fm.select(args.modules)
    except ValueError as e:
        sys.exit(f"scripts/build_gpu_kernels.py: {e}")
    cuda_home = os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    if not Path(cuda_home, "bin", "nvcc").exists():
        sys.exit(f"scripts/build_gpu_kernels.py: no nvcc in {cuda_home}/bin (set CUDA_HOME)")
    # no GPU here: name the target, or FlashInfer finds no architecture to build for
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = fm.TARGET_ARCH
    os.environ.setdefault("MAX_JOBS", "2")
    headers = extra_headers(cuda_home)
    stub = driver_stub(cuda_home)
    if stub is not None:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stub} {os.environ.get('FLASHINFER_EXTRA_LDFLAGS', '')}".strip()
    # the objects stay between runs (build/ is git-ignored): a rebuild after a failure resumes
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(ROOT / "build" / "flashinfer-workspace"))
    try:
        tools = toolchain(cuda_home)
    except ImportError as e:
        sys.exit(f"scripts/build_gpu_kernels.py: {e} (scripts/prepare_gpu_carry.sh installs FlashInfer in "
                 "build/flashinfer-site: PYTHONPATH=build/flashinfer-site)")
    if tools["flashinfer"] != fm.FLASHINFER_VERSION:
        sys.exit(f"scripts/build_gpu_kernels.py: flashinfer {tools['flashinfer']} here, the device gets "
                 f"{fm.FLASHINFER_VERSION} (scripts/fetch_gpu_wheels.sh)")

    args.out.mkdir(parents=True, exist_ok=True)
    fm.write_finder(args.out)
    manifest_path = args.out / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    kept = {e["key"]: e for e in old.get("modules", []) if old.get("toolchain") == tools}
    entries, left_out = [], []
    for module in chosen:
        entry = kept.get(module.key)
        if entry and not args.rebuild and (args.out / entry["file"]).is_file():
            entry.setdefault("needs", needs(args.out / entry["file"]))
            print(f"{module.key}: kept ({entry['bytes'] / 2**20:.1f} MiB)", flush=True)
        else:
            print(f"{module.key}: building ({module.what}) ...", flush=True)
            entry = build_one(module, args.out, headers)
            print(f"{module.key}: {entry['name']}.so {entry['bytes'] / 2**20:.1f} MiB in {entry['build_seconds']:.0f} s",
                  flush=True)
        total = sum(e["bytes"] for e in entries) + entry["bytes"]
        if args.max_bytes is not None and total > args.max_bytes:
            left_out.append(entry["key"])
            shutil.rmtree(args.out / Path(entry["file"]).parent, ignore_errors=True)
            print(f"{module.key}: left out, the folder would pass {args.max_bytes / 2**20:.0f} MiB", flush=True)
            continue
        entries.append(entry)
        write_manifest(manifest_path, tools, entries, kept, chosen, left_out, args.out)  # a failure later keeps it
    write_manifest(manifest_path, tools, entries, kept, chosen, left_out, args.out)
    total = sum(e["bytes"] for e in entries)
    print(f"gpu_kernels: {len(entries)} modules, {total / 2**20:.1f} MiB ({manifest_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
