"""``draft:DIR``: a smaller model with the target's tokenizer drafts greedily (speculative decoding;
here, not in ``engine/spec/``: it runs a model, and ``engine.config`` imports ``engine.spec``).

The draft model has paged KV of its own: a pool of its own (as many blocks as the target's, of
the same size, each smaller), a block table per sequence, and the target's attention backend
over it. A row's draft KV is kept between steps: each ``propose`` computes only the tokens the
draft model has not seen (the prompt at first, then the tokens the last step emitted past the
accepted drafts), then one position per drafted token. Positions whose tokens the target rejected
are recomputed, as the target's are. A sequence's draft blocks return to the pool once it has
finished or been preempted (looked for when the pool runs short: a preempted row drafts again
from nothing once readmitted, as the target recomputes its KV) or is gone.

Refused in one line: a draft model whose vocabulary differs from the target's (it would propose
ids that mean other text).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from engine.attention import AttentionBatch, create_backend
from engine.config import ModelConfig
from engine.loader import load_model
from engine.sequence import SeqStatus
from kvstore.cache import KVCache


class _DraftRow:
    __slots__ = ("blocks", "fed")

    def __init__(self) -> None:
        self.blocks: list[int] = []  # the row's draft KV blocks (its block table)
        self.fed: list[int] = []  # the tokens whose draft KV is in them, position by position


class DraftBlocks:
    """A drafter's own paged KV pool: its free blocks, and per sequence a row (``new_row()``; any
    object with a ``blocks`` list) holding some. Who frees: a finished or preempted sequence's row
    is dropped when the pool runs short (a preempted one kept its row, and the running rows would
    find no blocks to draft with), a sequence gone (garbage) gives its blocks back by a finalizer."""

    def __init__(self, num_blocks: int, block_size: int, new_row):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> row
        self._new_row = new_row

    def row(self, seq):
        row = self.rows.get(seq)
        if row is None:
            row = self.rows[seq] = self._new_row()
            weakref.finalize(seq, self.free.extend, row.blocks)  # a sequence gone: its blocks back
        return row

    def grow(self, row, positions: int) -> bool:
        """Blocks for ``positions`` positions; False (nothing taken) when the pool has too few."""
        need = -(-positions // self.block_size) - len(row.blocks)
        if need > len(self.free):
            self._release_idle()
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            row.blocks.append(self.free.pop())
        return True

    def _release_idle(self) -> None:
        """The rows of sequences that do not draft now: finished or preempted (a new row, from
        nothing, once readmitted)."""
        for seq, row in list(self.rows.items()):
            if seq.is_finished or seq.status == SeqStatus.PREEMPTED:
                self.free.extend(row.blocks)
                row.blocks.clear()  # the finalizer then gives back nothing
                del self.rows[seq]


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model_dir: str | Path, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, backend: str):
        mc = ModelConfig.from_dir(model_dir)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {model_dir} has a vocabulary of {mc.vocab_size} tokens, the target "
                             f"{target.vocab_size}: a draft model must share the target's tokenizer")
        self.block_size = block_size
        self.model = load_model(mc, device, dtype, max_positions=target.max_position)
        spec = mc.kv_cache_spec(num_blocks, block_size, dtype)
        self.attention = create_backend(backend, KVCache(spec, device), mc.attention_scale, mc.latent_value_dim)
        self.device = device
        self.kv = DraftBlocks(num_blocks, block_size, _DraftRow)

    def propose(self, seq, k: int) -> list[int]:
        row = self.kv.row(seq)
        tokens = seq.token_ids
        n = len(tokens)
        if not self.kv.grow(row, n + k - 1):
            return []
        valid = 0  # positions whose draft KV was computed from the tokens the sequence has now
        for a, b in zip(row.fed, tokens, strict=False):
            if a != b:
                break
            valid += 1
        valid = min(valid, n - 1)  # the last token is computed again: its logits propose the first draft
        with torch.inference_mode():
            draft = self._next(row, tokens[valid:], valid)
            drafts = [draft]
            for i in range(1, k):
                draft = self._next(row, [draft], n + i - 1)
                drafts.append(draft)
        row.fed = tokens + drafts[:-1]
        return drafts

    def _next(self, row: _DraftRow, ids: list[int], start: int) -> int:
        """The draft model's greedy token after ``ids`` at positions ``start``... (writing their KV)."""
        bs = self.block_size
        pos = torch.arange(start, start + len(ids), device=self.device)
        table = torch.as_tensor(row.blocks, dtype=torch.long, device=self.device)
        slots = table[pos // bs] * bs + pos % bs
        self.attention.plan(AttentionBatch([len(ids)], [start + len(ids)], [row.blocks], slots))
        hidden = self.model(torch.as_tensor(ids, dtype=torch.long, device=self.device), pos, self.attention)
        return int(self.model.logits(hidden[-1:]).argmax(dim=-1)[0])


def model_drafter(method: str | None, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                  num_blocks: int, block_size: int, backend: str) -> DraftModelDrafter | None:
    """The drafter of a method that runs a model (``draft:DIR``), else None (``create_drafter``'s)."""
    name, _, arg = (method or "").partition(":")
    if name != "draft":
        return None
    if not arg:
        raise ValueError("--speculative draft:DIR needs the draft model's directory")
    return DraftModelDrafter(arg, target, device, dtype, num_blocks, block_size, backend)
