"""Decode steps replayed from CUDA graphs.

An eager decode step of an 8B model launches ~850 kernels from Python, and on a
fast GPU the host cannot launch them as fast as the GPU runs them: the H200
profile showed the GPU busy for about half of each step. A CUDA graph records the
model's kernels once and replays them with one launch.

How it is built (the scheme vLLM and SGLang use):

* One graph per padded batch size (``BATCH_SIZES`` up to ``max_num_seqs``),
  captured the first time a decode step of that size comes. A step of ``n``
  sequences runs the graph of the smallest size ``B >= n``.
* The graph reads its inputs from static buffers (token ids, positions, KV
  slots) and writes its output (hidden states) to a static tensor; a step copies
  its inputs in and reads ``out[:n]``.
* Pad rows repeat the first row: the same token at the same position writes the
  same K/V into the same slot, so no KV slot is set aside for them, and their
  attention reads one token of the first row's first block. Their outputs are
  dropped.
* Attention plans outside the graph: the backend's CUDA-graph wrapper for size
  ``B`` keeps its page table in fixed buffers that ``plan`` refills before every
  replay (FlashInfer's ``use_cuda_graph`` mode).
* Only pure decode steps are graphed; prefill and mixed steps run eagerly. A
  capture that fails turns graphs off for the engine, with a warning: the step
  then runs eagerly, as every later one.

Off by default (``EngineConfig.cuda_graphs``, ``--cuda-graphs``): written in a
session whose device time ran out before its GPU tests could run.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from mesh.engine.attention import AttentionBatch

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in BATCH_SIZES if s < max_batch]
    return [*sizes, min(max_batch, BATCH_SIZES[-1])]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, attention, max_batch: int, device: torch.device):
        self.model = model
        self.attention = attention
        self.device = device
        self.num_heads = model.layers[0].self_attn.num_heads
        self.dtype = model.embed_tokens.weight.dtype
        self.sizes = batch_sizes(max_batch)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.zeros(top, dtype=torch.long, device=device)
        self._host = torch.zeros(3, top, dtype=torch.long, pin_memory=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.enabled = True
        self.replays = 0
        self.captures = 0

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of a pure decode step, or None when it is not graphed."""
        n = len(context_lens)
        size = self.bucket(n) if self.enabled else None
        if size is None:
            return None
        pad = size - n
        host = self._host[:, :size]
        for row, values in enumerate((input_ids, positions, slots)):
            host[row, :n] = torch.from_numpy(values)
            host[row, n:] = int(values[0])
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slots[:size].copy_(host[2], non_blocking=True)
        batch = AttentionBatch([1] * size, list(context_lens) + [1] * pad,
                               list(block_tables) + [block_tables[0][:1]] * pad, self.slots[:size])
        if self.attention.plan_graph(batch, self.num_heads, self.dtype):
            self.graphs.pop(size, None)  # captured on buffers that are gone
        if size not in self.graphs:
            try:
                self._capture(size)
            except Exception as e:  # an op that cannot be captured, out of memory: eager from now on
                log.warning("CUDA graph capture for batch %d failed (%s: %s); decode steps run eagerly",
                            size, type(e).__name__, e)
                self.enabled = False
                return None
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:n]

    def _capture(self, size: int) -> None:
        ids, pos = self.input_ids[:size], self.positions[:size]
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: library handles and workspaces, outside the capture
            self.model(ids, pos, self.attention)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # shared: graphs never run at the same time
        graph = torch.cuda.CUDAGraph()
        # thread_local: transports may use CUDA from other threads while this one captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model(ids, pos, self.attention)
        self.graphs[size] = (graph, out)
        self.captures += 1
        log.info("captured a CUDA graph for decode batches of %d", size)
