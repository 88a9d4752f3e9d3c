"""Executes one ``SchedulerOutput``: builds the flat batch, runs the model, samples."""

from __future__ import annotations

import numpy as np
import torch

from mesh.engine.attention import AttentionBackend, AttentionBatch
from mesh.engine.model import CausalLM
from mesh.engine.sampler import Sampler
from mesh.engine.scheduler import SchedulerOutput
from mesh.engine.sequence import SampledToken


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, sampler: Sampler, block_size: int):
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.block_size = block_size
        self.device = next(model.parameters()).device
        # Tests and debugging: keep the logits of every row of the last step.
        self.capture_logits = False
        self.last_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        bs = self.block_size
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        batch = AttentionBatch([], [], [], torch.empty(0))
        sample_rows: list[int] = []
        row = 0
        for c in out.chunks:
            seq = c.seq
            p = np.arange(c.start, c.end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.tokens_between(c.start, c.end), dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            batch.query_lens.append(c.num_tokens)
            batch.context_lens.append(c.end)
            batch.block_tables.append(seq.block_table)
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
        input_ids = self._to_device(np.concatenate(ids))
        positions = self._to_device(np.concatenate(pos))
        batch.slot_mapping = self._to_device(np.concatenate(slots))
        self.attention.plan(batch)
        hidden = self.model(input_ids, positions, self.attention)
        if self.capture_logits:
            self.last_logits = self.model.logits(hidden)
        if not sample_rows:
            return []
        rows = torch.as_tensor(sample_rows, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return self.sampler(logits, [c.seq for c in out.sampling_chunks])

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t
