"""A helper rank of a tensor-parallel engine: ``python -m engine.tp_rank FD`` (see ``engine.tp``).

Rank 0 (``TensorParallel``) starts this process with one end of a socket pair as ``FD``; the
helper reads its ``RankSetup``, loads its shard of the model, makes its share of the KV cache,
answers with where that share lives, joins the process group and runs each step rank 0 sends,
until the pipe closes: a ``StepInputs`` (a step: plan and forward) or an EAGLE-3
``RebuildStep`` (the target's layers up to its last auxiliary one, on rank 0's request while it
schedules; ``engine.eagle3``). It lives apart from ``engine.tp`` because it builds a whole model
runner (loader, model, attention), which rank 0's side of the group never needs.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from engine.attention import create_backend
from engine.config import ModelConfig
from engine.eagle3 import RebuildStep, TargetStates
from engine.kernels import Kernels
from engine.loader import load_model
from engine.model import use_kernels
from engine.runner import ModelRunner
from engine.tp import READY_TIMEOUT, RankSetup, Shard, join_group, rank_device, shard_spec
from kvstore.cache import KVCache

log = logging.getLogger(__name__)


def _serve(conn: Connection) -> int:
    setup: RankSetup = conn.recv()
    logging.basicConfig(level=setup.log_level, format=f"%(asctime)s %(levelname)s tp{setup.rank} %(name)s: %(message)s")
    torch.set_num_threads(setup.threads)
    cfg = setup.config
    mc = ModelConfig.from_dir(cfg.model)
    device = rank_device(cfg.torch_device, setup.rank)
    shard = Shard(setup.rank, setup.size)
    model = load_model(mc, device, cfg.torch_dtype, setup.max_len, shard)
    use_kernels(model, Kernels.select(cfg.fused_kernels))  # the same ops as rank 0's
    spec = shard_spec(mc, cfg, setup.num_blocks, cfg.torch_dtype)
    kv = KVCache(spec, device, shm_path=setup.kv_path)
    attention = create_backend(cfg.attention_backend, kv, mc.head_dim**-0.5)
    runner = ModelRunner(model, attention, None, cfg.block_size)
    if device.type == "cpu":
        where = setup.kv_path
    else:
        where = reduce_tensor(kv.tensor)
    conn.send((spec.to_dict(), where))
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.size, is_master=False,
                          timeout=timedelta(seconds=READY_TIMEOUT))
    shard.group = join_group(store, setup.rank, setup.size, device)
    rebuild: TargetStates | None = None  # made at the first RebuildStep (EAGLE-3 only)
    while True:
        try:
            step = pickle.loads(conn.recv_bytes())
        except EOFError:
            return 0  # rank 0 is gone
        if step is None:
            return 0
        if isinstance(step, RebuildStep):
            rebuild = rebuild or TargetStates(model, kv, cfg.attention_backend)
            rebuild(step)  # this rank's share of the all-reduces; the states are rank 0's to keep
        else:
            runner.forward(step)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        return _serve(conn)
    except (EOFError, BrokenPipeError):
        return 0
    except Exception:
        log.exception("tensor-parallel rank failed")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
