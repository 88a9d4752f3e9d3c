"""The GPU execution switches (issue 21): flags -> EngineConfig, their checks, their defaults.

On CPU: what the flags select is tested on a GPU (tests/gpu); here, that they reach the
config, that contradictions and unknown names are one-line errors, and that the defaults are
the constants a GPU run would flip.
"""

from __future__ import annotations

import pytest

import cli
from engine import config as engine_config_module
from engine.config import EngineConfig
from engine.engine import Engine
from engine.flags import gpu_execution_argv
from engine.kernels import FUSED_KERNELS, Kernels, parse_fused_kernels


def worker_args(model, *flags):
    return cli.build_parser().parse_args(["worker", "decode", "--nats", "nats://127.0.0.1:1", "--model", str(model),
                                          *flags])


def test_flags_reach_the_engine_config(tiny_model):
    args = worker_args(tiny_model, "--async-scheduling", "--enforce-eager", "--fused-kernels", "rope,sampling",
                       "--attention-backend", "flashinfer-ragged")
    cfg = cli.engine_config(args)
    assert cfg.async_scheduling is True and cfg.enforce_eager and not cfg.use_cuda_graphs
    assert cfg.fused_kernels == ("rope", "sampling") and cfg.attention_backend == "flashinfer-ragged"
    plain = cli.engine_config(worker_args(tiny_model))
    assert (plain.async_scheduling, plain.cuda_graphs, plain.fused_kernels) == (None, None, ())
    assert cli.engine_config(worker_args(tiny_model, "--no-async-scheduling")).async_scheduling is False
    assert cli.engine_config(worker_args(tiny_model, "--fused-kernels", "all")).fused_kernels == FUSED_KERNELS


def test_mesh_up_passes_the_flags_on_to_its_workers(tiny_model):
    args = worker_args(tiny_model, "--cuda-graphs", "--no-async-scheduling", "--fused-kernels", "add_rmsnorm")
    flags = gpu_execution_argv(args)
    again = cli.engine_config(worker_args(tiny_model, *flags))
    assert (again.cuda_graphs, again.async_scheduling, again.fused_kernels) == (True, False, ("add_rmsnorm",))


@pytest.mark.parametrize(("flags", "message"), [
    (["--fused-kernels", "rope,warp_speed"], "unknown fused kernel"),
    (["--enforce-eager", "--cuda-graphs"], "contradict"),
    (["--attention-backend", "tensorrt"], "unknown attention backend"),
    (["--cuda-graphs", "--pp", "2"], "--pp 2 does not run with --cuda-graphs"),
    (["--cuda-graphs", "--tp", "2"], "--cuda-graphs is not supported with --tp 2"),
    (["--peer-pin-max-s", "0"], "--peer-pin-max-s must be > 0"),
])
def test_bad_combinations_are_one_line_errors(tiny_model, capsys, flags, message):
    rc = cli.main(["worker", "decode", "--nats", "nats://127.0.0.1:1", "--model", str(tiny_model), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_mocker_refuses_model_flags(capsys):
    rc = cli.main(["worker", "mock", "--nats", "nats://127.0.0.1:1", "--async-scheduling"])
    err = capsys.readouterr().err
    assert rc == 2 and "mocker runs no model" in err


def test_defaults_are_the_constants_a_gpu_run_flips(tiny_model, monkeypatch):
    cfg = EngineConfig(tiny_model, device="cuda")  # a config only: nothing touches a device here
    assert cfg.use_cuda_graphs is engine_config_module.CUDA_GRAPHS_DEFAULT is False
    assert cfg.use_async_scheduling is engine_config_module.ASYNC_SCHEDULING_DEFAULT_CUDA is False
    monkeypatch.setattr(engine_config_module, "CUDA_GRAPHS_DEFAULT", True)
    monkeypatch.setattr(engine_config_module, "ASYNC_SCHEDULING_DEFAULT_CUDA", True)
    assert cfg.use_cuda_graphs and cfg.use_async_scheduling
    assert not EngineConfig(tiny_model, device="cuda", enforce_eager=True).use_cuda_graphs
    assert not EngineConfig(tiny_model, device="cpu").use_async_scheduling  # the default is CUDA's only
    assert not EngineConfig(tiny_model, device="cuda", async_scheduling=False).use_async_scheduling


def test_fused_kernels_need_cuda(tiny_model):
    with pytest.raises(ValueError, match="CUDA only"):
        Engine(EngineConfig(tiny_model, device="cpu", fused_kernels=("rope",)))


def test_kernel_selection():
    assert Kernels.select().names == frozenset() and Kernels.select().top_k_top_p is None
    with pytest.raises(ValueError, match="unknown fused kernel"):
        Kernels.select(("nope",))
    assert parse_fused_kernels("") == () and parse_fused_kernels("none") == ()
    assert parse_fused_kernels(" rope , silu_and_mul ") == ("rope", "silu_and_mul")
