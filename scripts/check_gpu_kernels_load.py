"""Load every carried FlashInfer module the way the device will, as far as a CPU machine can.

    build/tvm-ffi-py312/bin/python scripts/check_gpu_kernels_load.py [gpu_kernels]

Run with a Python 3.12 that has only the apache-tvm-ffi wheel the device installs (the device's
interpreter is 3.12; the modules are built under another): each module's file is checked against
the manifest, loaded with ``tvm_ffi.load_module`` (a dlopen: its libraries and symbols resolve,
with the CUDA driver's stub library standing in for the driver), and asked for the functions
FlashInfer's Python calls on it. What this cannot show: that the kernels run, which needs the GPU.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import flashinfer_modules as fm  # noqa: E402


def main(argv: list[str]) -> int:
    carry = Path(argv[0]) if argv else fm.CARRY_DIR
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
        except Exception as e:  # a load that fails on the CPU fails on the device too: say why
            print(f"FAIL {entry['key']}: {type(e).__name__}: {e}")
            bad += 1
            continue
        if missing:
            print(f"FAIL {entry['key']}: loads, but has no {', '.join(missing)}")
            bad += 1
        else:
            print(f"ok   {entry['key']}: {entry['name']}.so loads, has {', '.join(module.functions)}")
    print(f"{len(manifest['modules']) - bad} of {len(manifest['modules'])} carried modules load here")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
