"""One engine's decode steps under torch.profiler: where a step's time goes.

``profile_decode`` runs ``STEPS`` decode steps of a batch under the profiler and breaks one
step down: the GPU kernel time against the wall time (the difference is the host gap that CUDA
graphs and overlapped scheduling exist to close), the kernel launches and the host time spent
in the launch calls, and the top kernels by time. On the CPU (``--dry-run``) the same code
reports the top operators by their own CPU time instead, so the breakdown's plumbing runs too.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
TOP = 10  # kernels (or CPU operators) listed per profile


@dataclass
class TopKernel:
    name: str
    ms_per_step: float
    calls_per_step: float
    share: float  # of the step's kernel time (CPU: of its wall time)


@dataclass
class StepProfile:
    mode: str
    batch: int
    steps: int
    device: str  # "cuda" or "cpu"
    wall_ms: float  # per step
    kernel_ms: float | None  # GPU kernel time per step (None on the CPU)
    host_gap_ms: float | None  # wall - kernels: the GPU idle while the host works
    launches: float | None  # kernel and graph launches per step
    launch_api_ms: float | None  # host time inside those launch calls per step
    top: list[TopKernel] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def breakdown(events, steps: int, wall_s: float, cuda: bool) -> dict:
    """The per-step figures of a profiler's ``key_averages()``."""
    from torch.autograd import DeviceType

    if cuda:
        # kernel rows only: an ATen op's row repeats the time of the kernels it launched
        rows = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
        time_us = {e.key: e.self_device_time_total for e in rows}
        total_us = sum(time_us.values())
    else:
        rows = [e for e in events if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0]
        time_us = {e.key: e.self_cpu_time_total for e in rows}
        total_us = wall_s * 1e6
    count = {e.key: e.count for e in rows}
    top = sorted(time_us, key=time_us.get, reverse=True)[:TOP]
    launch_rows = [e for e in events if e.key.startswith(LAUNCH_CALLS)]
    kernel_ms = sum(time_us.values()) / steps / 1e3 if cuda else None
    wall_ms = wall_s / steps * 1e3
    return {
        "kernel_ms": kernel_ms,
        "host_gap_ms": None if kernel_ms is None else wall_ms - kernel_ms,
        "launches": sum(e.count for e in launch_rows) / steps if cuda else None,
        "launch_api_ms": sum(e.self_cpu_time_total for e in launch_rows) / steps / 1e3 if cuda else None,
        "top": [TopKernel(_short(k), time_us[k] / steps / 1e3, count[k] / steps,
                          time_us[k] / total_us if total_us else 0.0) for k in top],
    }


def profile_decode(engine, seqs: list, mode: str, steps: int) -> StepProfile:
    """``steps`` decode steps of the sequences ``seqs`` (already added, prefilled and past their
    first decode step, so graph capture and JIT are outside) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    figures = breakdown(prof.key_averages(), steps, wall, cuda)
    return StepProfile(mode, len(seqs), steps, engine.device.type, wall / steps * 1e3, **figures)


def print_profiles(profiles: list[StepProfile]) -> None:
    for p in profiles:
        what = "GPU kernels" if p.device == "cuda" else "CPU operators (dry run: no kernel times)"
        head = f"\nprofile: {p.mode}, batch {p.batch}, {p.steps} decode steps: {p.wall_ms:.2f} ms/step wall"
        if p.kernel_ms is not None:
            head += (f", kernels {p.kernel_ms:.2f} ms, host gap {p.host_gap_ms:.2f} ms, {p.launches:.0f} launches "
                     f"({p.launch_api_ms:.2f} ms in launch calls)")
        print(head)
        print(f"  top {what}, per step:")
        for k in p.top:
            print(f"  {k.ms_per_step:8.3f} ms {k.share:6.1%} {k.calls_per_step:6.1f}x  {k.name}")
