"""A helper rank of a worker's layout: ``python -m engine.parallel.rank FD`` (see ``engine.parallel.group``).

Rank 0 (``RankGroup``) starts this process with one end of a socket pair as ``FD``; the helper
reads its ``RankSetup``, loads its part of the model (its stage's layers, its share of the
heads), makes its part of the KV cache, answers with where that part lives, joins its groups
and runs what rank 0 sends until the pipe closes: a ``StageStep`` (its stage of each
micro-batch), an EAGLE-3 ``RebuildStep`` (tensor parallelism alone: the target's layers up to
its last auxiliary one, on rank 0's request while it schedules; ``engine.eagle3``), or a
``StatsRequest``. It lives apart from ``engine.parallel.group`` because it builds a model,
which rank 0's side of the group never needs.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
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
from engine.parallel.group import RankSetup, StatsRequest, rank_kv_spec
from engine.parallel.stage import LayerWindow, StageRunner, StageStep
from engine.tp import Shard
from kvstore.cache import KVCache

log = logging.getLogger(__name__)


def _serve(conn: Connection) -> int:
    setup: RankSetup = conn.recv()
    layout, cfg = setup.layout, setup.config
    place = layout.place(setup.rank)
    logging.basicConfig(level=setup.log_level,
                        format=f"%(asctime)s %(levelname)s rank{setup.rank} %(name)s: %(message)s")
    torch.set_num_threads(setup.threads)
    mc = ModelConfig.from_dir(cfg.model)
    device = rank_device(cfg.torch_device, setup.rank)
    shard = Shard(place.tp_rank, layout.tp)
    layers = layout.layers(place.stage)
    model = load_model(mc, device, cfg.torch_dtype, setup.max_len, shard,
                       ModelPart(layers, embeds=place.stage == 0, samples=False))
    use_kernels(model, Kernels.select(cfg.fused_kernels))  # the same ops as rank 0's
    spec = rank_kv_spec(mc, layout, place.stage, setup.num_blocks, cfg.block_size, cfg.torch_dtype)
    kv = KVCache(spec, device, shm_path=setup.kv_path)
    window = LayerWindow(kv, layers.start)
    attention = create_backend(cfg.attention_backend, window, mc.head_dim**-0.5)
    configure = getattr(attention, "configure", None)
    if configure is not None:  # as rank 0's runner configures its own
        configure(model.layers[layers.start].self_attn.num_heads, cfg.torch_dtype)
    conn.send((spec.to_dict(), setup.kv_path if device.type == "cpu" else reduce_tensor(kv.tensor)))
    store = open_store(setup.store_host, setup.store_port, layout.size, master=False)
    groups = join_groups(store, layout, setup.rank, device, setup.store_host)
    shard.group = groups.tp
    stage = StageRunner(model, attention, layout, setup.rank, groups, device, cfg.torch_dtype)
    rebuild: TargetStates | None = None  # made at the first RebuildStep (EAGLE-3 only)
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return 0  # rank 0 is gone
        if message is None:
            return 0
        if isinstance(message, StageStep):
            stage.run(message)
        elif isinstance(message, RebuildStep):
            rebuild = rebuild or TargetStates(model, window, cfg.attention_backend)
            rebuild(message)  # this rank's share of the all-reduces; the states are rank 0's to keep
        elif isinstance(message, StatsRequest):
            conn.send(stage.take_stats(message.reset))
        else:
            raise TypeError(f"rank {setup.rank}: unknown message {type(message).__name__}")


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        return _serve(conn)
    except (EOFError, BrokenPipeError):
        return 0
    except Exception:
        log.exception("rank failed")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
