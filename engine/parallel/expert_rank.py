"""A rank that holds routed experts only (``--ep`` above ``--tp``; ``engine.parallel.experts``).

It loads its share of the routed experts of every MoE layer and nothing else (no attention, no
KV cache, no router, no shared or dense MLPs), answers rank 0's setup with no KV part, joins its
groups (only the EP group) and then, per forward a message from rank 0 announces (each
micro-batch of a ``StageStep``, an EAGLE-3 ``RebuildStep``), serves the token ranks' exchanges
until they mark the forward's end. It never needs a step's contents: what it computes is what
the token ranks send.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.config import ModelConfig
from engine.eagle3 import RebuildStep
from engine.loader import load_model
from engine.model import ModelPart
from engine.moe import SparseMoE
from engine.parallel.comm import join_groups, open_store, rank_device
from engine.parallel.experts import expert_shard
from engine.parallel.group import RankSetup, StatsRequest
from engine.parallel.lifeline import Lifeline
from engine.parallel.stage import StageStats, StageStep
from engine.tp import Shard

log = logging.getLogger(__name__)


def serve_experts(link: Lifeline, setup: RankSetup) -> int:
    layout, cfg = setup.layout, setup.config
    place = layout.place(setup.rank)
    mc = ModelConfig.from_dir(cfg.model)
    device = rank_device(cfg.torch_device, setup.rank)
    shard = Shard(0, 1, experts=expert_shard(layout, setup.rank))
    model = load_model(mc, device, cfg.torch_dtype, setup.max_len, shard,
                       ModelPart(layout.layers(place.stage), embeds=False, samples=False, attention=False))
    experts = {m.layer: m.experts for m in model.modules() if isinstance(m, SparseMoE)}
    log.info("rank %d holds experts %s of MoE layers %s", setup.rank,
             shard.experts.local(mc.moe.num_experts), sorted(experts))
    link.send((None, None))  # ready, with no KV part
    store = open_store(setup.store_host, setup.store_port, layout.size, master=False)
    groups = join_groups(store, layout, setup.rank, device, setup.store_host)
    shard.join(None, groups.ep)
    dispatch = shard.experts.dispatch
    stats = StageStats(setup.rank, place.stage)

    def serve(forwards: int) -> None:
        t0, waited = time.perf_counter(), dispatch.seconds
        with torch.inference_mode():
            for _ in range(forwards):
                dispatch.serve(experts, mc.moe.num_experts, mc.hidden_size, cfg.torch_dtype, device)
        stats.busy_s += time.perf_counter() - t0 - (dispatch.seconds - waited)
        stats.microbatches += forwards
        stats.steps += 1

    for message in link.messages():  # until rank 0 closes the group or is gone
        if isinstance(message, StageStep):
            serve(len(message.microbatches))
        elif isinstance(message, RebuildStep):
            serve(1)
        elif isinstance(message, StatsRequest):
            link.send(StageStats(**vars(stats)))
            if message.reset:
                stats = StageStats(setup.rank, place.stage)
        else:
            raise TypeError(f"rank {setup.rank}: unknown message {type(message).__name__}")
    return 0
