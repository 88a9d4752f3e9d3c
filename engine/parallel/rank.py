"""A helper rank of a worker's layout: ``python -m engine.parallel.rank FD AGENT_FD`` (see
``engine.parallel.group``), or ``mesh rank --join WORKER`` on another host (``serve_joined``: the
same, over a lifeline across hosts, with no KV agent channel).

Rank 0 (``RankGroup``) starts this process with one end of a socket pair as ``FD``; the helper
reads its ``RankSetup``, loads its part of the model (its stage's layers, its share of the
heads), makes its part of the KV cache, answers with where that part lives, joins its groups
and runs what rank 0 sends until the pipe closes: a ``StageStep`` (its stage of each
micro-batch), an EAGLE-3 ``RebuildStep`` (tensor parallelism alone: the target's layers up to
its last auxiliary one, on rank 0's request while it schedules; ``engine.eagle3``), or a
``StatsRequest``. ``AGENT_FD``, a second socket pair, is its KV part's transfer agent's channel,
served on a thread of its own (``kvstore.transfer.nixl_ranks``: nixl, whose agent must sit in
the process that holds the memory). (A rank that holds experts only runs ``engine.parallel.expert_rank``.) It
lives apart from ``engine.parallel.group`` because it builds a model, which rank 0's side of
the group never needs.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
from torch.multiprocessing.reductions import reduce_tensor

from engine.attention import create_backend
from engine.config import ModelConfig
from engine.eagle3 import RebuildStep, TargetStates
from engine.kernels import Kernels
from engine.loader import load_model
from engine.model import ModelPart, use_kernels
from engine.parallel.comm import join_groups, open_store, rank_device
from engine.parallel.expert_rank import serve_experts
from engine.parallel.experts import expert_shard
from engine.parallel.group import RankSetup, StatsRequest, rank_kv_spec
from engine.parallel.lifeline import Lifeline
from engine.parallel.stage import LayerWindow, StageRunner, StageStep
from engine.tp import Shard
from kvstore.cache import KVCache
from kvstore.transfer.nixl_ranks import RankAgentService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankHost:
    """What a rank on another host takes from its own host rather than from rank 0's setup."""

    addr: str  # where its process groups listen (its address toward rank 0)
    model: str | None = None  # the model directory here (None: the path rank 0 has)
    device: str | None = None  # None: the CPU, or the first GPU
    threads: int | None = None  # torch threads (None: torch's default, from this host's cores)


def _device(setup: RankSetup, host: RankHost | None) -> torch.device:
    cfg = setup.config
    if host is None:
        return rank_device(cfg.torch_device, setup.rank)
    if host.device:
        return torch.device(host.device)
    return torch.device("cuda", 0) if cfg.torch_device.type == "cuda" else torch.device("cpu")


class RankRefused(Exception):
    """Rank 0 closed a joined rank's lifeline before its setup: why, in one line."""


def _serve(link: Lifeline, host: RankHost | None = None, agent_conn: Connection | None = None) -> int:
    try:
        setup: RankSetup = link.recv()
    except EOFError:
        raise RankRefused("the worker closed the group before this rank started") from None
    if isinstance(setup, str):  # a joined rank's connection refused after the handshake
        raise RankRefused(setup)
    layout, cfg = setup.layout, setup.config
    place = layout.place(setup.rank)
    logging.basicConfig(level=setup.log_level,
                        format=f"%(asctime)s %(levelname)s rank{setup.rank} %(name)s: %(message)s")
    torch.set_num_threads(setup.threads if host is None else host.threads or torch.get_num_threads())
    if place.experts_only:
        return serve_experts(link, setup)
    model_dir = (host.model if host else None) or cfg.model
    mc = ModelConfig.from_dir(model_dir)
    device = _device(setup, host)
    shard = Shard(place.tp_rank, layout.tp, experts=expert_shard(layout, setup.rank))
    layers = layout.layers(place.stage)
    model = load_model(mc, device, cfg.torch_dtype, setup.max_len, shard,
                       ModelPart(layers, embeds=place.stage == 0, samples=False))
    use_kernels(model, Kernels.select(cfg.fused_kernels))  # the same ops as rank 0's
    spec = rank_kv_spec(mc, layout, place.stage, setup.num_blocks, cfg.block_size, cfg.kv_torch_dtype)
    kv = KVCache(spec, device, shm_path=setup.kv_path)
    if agent_conn is not None:  # this rank's KV transfer agent, made when rank 0 asks (nixl)
        RankAgentService(agent_conn, kv.tensor).start()
    window = LayerWindow(kv, layers.start)
    attention = create_backend(cfg.attention_backend, window, mc.head_dim**-0.5)
    configure = getattr(attention, "configure", None)
    if configure is not None:  # as rank 0's runner configures its own
        configure(model.layers[layers.start].self_attn.num_heads, cfg.torch_dtype)
    # where rank 0 finds this part: a file it maps, a CUDA IPC handle, or (another host) nowhere
    where = None if host else setup.kv_path if device.type == "cpu" else reduce_tensor(kv.tensor)
    link.send((spec.to_dict(), where))
    store = open_store(setup.store_host, setup.store_port, layout.size, master=False)
    groups = join_groups(store, layout, setup.rank, device, host.addr if host else setup.store_host)
    shard.join(groups.tp, groups.ep)
    stage = StageRunner(model, attention, layout, setup.rank, groups, device, cfg.torch_dtype)
    rebuild: TargetStates | None = None  # made at the first RebuildStep (EAGLE-3 only)
    for message in link.messages():  # until rank 0 closes the group or is gone
        if isinstance(message, StageStep):
            stage.run(message)
        elif isinstance(message, RebuildStep):
            rebuild = rebuild or TargetStates(model, window, cfg.attention_backend)
            rebuild(message)  # this rank's share of the all-reduces; the states are rank 0's to keep
        elif isinstance(message, StatsRequest):
            link.send(stage.take_stats(message.reset))
        else:
            raise TypeError(f"rank {setup.rank}: unknown message {type(message).__name__}")
    return 0


def serve_joined(link: Lifeline, host: RankHost) -> int:
    """A rank on another host, its lifeline to rank 0 open: serve until rank 0 closes the group
    (0); when rank 0 is lost the lifeline's ``on_lost`` ends the process. Exceptions propagate."""
    return _serve(link, host)


def main(argv: list[str]) -> int:
    """``argv``: the step pipe's descriptor, then the KV agent channel's (``kvstore.transfer.nixl_ranks``)."""
    # Ctrl-C reaches the whole process group: rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    link = Lifeline(Connection(int(argv[0])))
    try:
        return _serve(link, agent_conn=Connection(int(argv[1])) if len(argv) > 1 else None)
    except (EOFError, BrokenPipeError):
        return 0
    except Exception:
        log.exception("rank failed")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
