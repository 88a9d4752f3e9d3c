"""Decode steps replayed from CUDA graphs.

An eager decode step of an 8B model launches ~850 kernels from Python, and on a
fast GPU the host cannot launch them as fast as the GPU runs them: the H200
profile showed the GPU busy for about half of each step. A CUDA graph records the
model's kernels once and replays them with one launch.

How it is built (the scheme vLLM and SGLang use):

* One graph per padded batch size (``batch_sizes(max_num_seqs)``), captured the
  first time a decode step of that size comes (or all at start: ``capture_all``).
  A step of ``n`` sequences runs the graph of the smallest size ``B >= n``.
* The graph reads its inputs from static buffers (``StaticDecodeBatch``: token
  ids, positions, KV slots) and writes its output (hidden states) to a static
  tensor; a step copies its inputs in and reads ``out[:n]``.
* Pad rows write a scratch KV block that no sequence owns: token 0 at position 0
  into slot 0 of the scratch block, attending over that one slot. Their outputs
  are dropped. They must not share a real row's slot: from layer 1 on a pad row's
  K/V differ from the real row's, and whichever write lands last would be the
  cache (the bug this replaced: pad rows repeated row 0 and corrupted its KV).

  Who owns the scratch block: the engine takes it from the block pool when it
  builds the graphs (so the scheduler can never hand it out and the pool's
  accounting counts it as used) and never frees it; nothing else writes it.
* Attention plans outside the graph: the backend's CUDA-graph wrapper for size
  ``B`` keeps its page table in fixed buffers that ``plan_graph`` refills before
  every replay (FlashInfer's ``use_cuda_graph`` mode).
* Only pure decode steps are graphed; prefill and mixed steps run eagerly. A
  capture that fails turns graphs off for the engine, with a warning: the step
  then runs eagerly, as every later one.

Whether an engine uses graphs: ``EngineConfig.use_cuda_graphs`` (``--cuda-graphs``
on, ``--enforce-eager`` off; the default is ``config.CUDA_GRAPHS_DEFAULT``, off until
a GPU run of ``tests/gpu`` confirms them: flipping it is the one-line change).
Capture memory is set aside in the KV budget (``graph_memory_bytes``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import AttentionBatch

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
LARGE_BATCH_STEP = 32  # above the table, one graph every 32 sequences up to max_num_seqs
PAD_TOKEN = 0


def batch_sizes(max_batch: int) -> list[int]:
    """The padded sizes a decode batch of 1..max_batch sequences runs at (the last is max_batch)."""
    sizes = [s for s in BATCH_SIZES if s < max_batch]
    top = sizes[-1] if sizes else 0
    sizes += list(range(top + LARGE_BATCH_STEP, max_batch, LARGE_BATCH_STEP)) if top >= BATCH_SIZES[-1] else []
    return [*sizes, max_batch]


class StaticDecodeBatch:
    """The fixed input buffers a decode graph reads, and how a batch of ``n`` is padded to ``size``.

    Device-agnostic (the CPU tests run the very same padding through the torch backend).
    ``fill`` is host work only: copies go out non-blocking.
    """

    def __init__(self, max_size: int, device: torch.device, scratch_block: int, block_size: int):
        self.device = device
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_size, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        # Reused every step: the runner waits until the previous step's copies left it (inputs_ready)
        self._host = torch.zeros(2, max_size, dtype=torch.long, pin_memory=pin)

    def fill(self, input_ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray,
             context_lens: list[int], block_tables: list[list[int]], size: int) -> AttentionBatch:
        """Copy a decode batch of ``n = len(context_lens)`` rows in, padded to ``size``; the
        attention layout of the padded batch. ``input_ids`` is on the device already (with
        overlapped scheduling some of them were sampled there and never seen by the host)."""
        n = len(context_lens)
        pad = size - n
        host = self._host[:, :size]
        host[0, :n] = torch.from_numpy(positions)
        host[1, :n] = torch.from_numpy(slots)
        host[0, n:] = 0
        host[1, n:] = self.scratch_slot
        self.positions[:size].copy_(host[0], non_blocking=True)
        self.slots[:size].copy_(host[1], non_blocking=True)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:size].fill_(PAD_TOKEN)
        scratch = [self.scratch_block]
        return AttentionBatch([1] * size, list(context_lens) + [1] * pad,
                              list(block_tables) + [scratch] * pad, self.slots[:size])


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, attention, max_batch: int, device: torch.device,
                 scratch_block: int, block_size: int):
        self.model = model
        self.attention = attention
        self.device = device
        self.num_heads = model.layers[0].self_attn.num_heads
        self.dtype = model.embed_tokens.weight.dtype
        self.sizes = batch_sizes(max_batch)
        self.inputs = StaticDecodeBatch(self.sizes[-1], device, scratch_block, block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._side: torch.cuda.Stream | None = None  # one warm-up stream: its freed blocks serve the next
        self.enabled = True
        self.replays = 0
        self.captures = 0

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def prepare(self, input_ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray,
                context_lens: list[int], block_tables: list[list[int]]) -> int | None:
        """Fill the static inputs and plan attention for a pure decode step (capturing its graph
        if it is the first of its size); the padded size to ``replay``, or None: run it eagerly."""
        n = len(context_lens)
        size = self.bucket(n) if self.enabled else None
        if size is None:
            return None
        batch = self.inputs.fill(input_ids, positions, slots, context_lens, block_tables, size)
        if self.attention.plan_graph(batch, self.num_heads, self.dtype):
            self.graphs.pop(size, None)  # captured on buffers that are gone
        if size not in self.graphs and not self._try_capture(size):
            return None
        return size

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of the prepared step."""
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:n]

    def capture_all(self) -> None:
        """Capture every size now (at engine start) rather than at the first step of each size."""
        for size in reversed(self.sizes):  # largest first: later ones fit in its pool blocks
            batch = self.inputs.fill(self.inputs.input_ids[:0], np.zeros(0, np.int64), np.zeros(0, np.int64),
                                     [], [], size)
            self.attention.plan_graph(batch, self.num_heads, self.dtype)
            if not self._try_capture(size):
                return

    def _try_capture(self, size: int) -> bool:
        try:
            self._capture(size)
        except Exception as e:  # an op that cannot be captured, out of memory: eager from now on
            log.warning("CUDA graph capture for batch %d failed (%s: %s); decode steps run eagerly",
                        size, type(e).__name__, e)
            self.enabled = False
            return False
        return True

    def _capture(self, size: int) -> None:
        ids, pos = self.inputs.input_ids[:size], self.inputs.positions[:size]
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
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


FLASHINFER_WRAPPER_BYTES = 10 << 20  # a CUDA-graph decode wrapper per size: 8 MiB int workspace + buffers


def graph_memory_bytes(hidden: int, intermediate: int, qkv_width: int, max_batch: int, elem: int) -> int:
    """A bound on what decode graphs up to ``max_batch`` rows take (for the KV budget): the
    graph pool holds the live activations of one layer (residual, norm, qkv, attention out,
    gate/up, act, down) at the largest size, twice over for the allocator's rounding; each
    size has its own attention wrapper (FlashInfer's keeps an 8 MiB workspace); plus 64 MiB
    for the warm-up passes and per-graph state. ``tests/gpu`` checks it against a capture."""
    per_row = (6 * hidden + 3 * intermediate + 2 * qkv_width) * elem
    sizes = len(batch_sizes(max_batch))
    return 2 * max_batch * per_row + sizes * FLASHINFER_WRAPPER_BYTES + (64 << 20)
