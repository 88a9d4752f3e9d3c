"""Drafters that read the target's hidden states: an EAGLE-3 head (``engine.eagle3_drafter``) and
DeepSeek-V3's MTP layer (``engine.mtp_drafter``). Both are one decoder layer of their own (the
head) run on [the next token's embedding; a hidden state]; what they read of the target and how
their head is built differ, the rest is here.

The target keeps the states the drafter reads for every token it computes (``CausalLM.aux_layers``,
set only when such a drafter is configured: the inputs of some layers, ``len(layers)`` the last
layer's output); after each step the engine hands them here (``capture``), made into the head's
hidden states by ``fuse`` (EAGLE-3's ``fc``, MTP's final norm), per drafting row by position. A
row's head KV (a pool of its own, one layer, as many blocks as the target's) is kept between
steps: head position i holds the token at i + 1 with the target's state at i, so a row of n
tokens has every position below n - 1 computed from accepted tokens only. ``propose`` computes
the positions not yet computed (their states are the target's), then one position per drafted
token, whose hidden state is the head's own pre-norm output at the position before (as vLLM and
SGLang run EAGLE-3 and MTP). States past n - 2 were computed with drafts the target rejected, or
not at all: they are never read, and the next step's capture replaces them.

Why a pool of its own and not the target's block ids: head position i depends on the token at
i + 1, which a target block's hash does not name (two sequences sharing a cached block may go on
differently), and the target's blocks travel through tiers and transports that carry the
target's layers only.

Tokens the target did not compute here have no states: a prefix-cache hit, the prompt of a
disaggregated request (its KV came from a prefill worker), a migrated sequence. ``propose``
rebuilds them (``_rebuild``): the target's layers up to the last one read run over those tokens,
reading the target's KV (their own keys and values are written to a scratch block, so the cached
blocks are never written). ``rebuilt_tokens`` counts them. Under tensor parallelism the head runs
on rank 0 only (it is one layer, and its drafts go to rank 0's scheduler), on the states rank 0
keeps (the residual stream is whole on every rank); a rebuild runs on every rank
(``engine.eagle3.RebuildStep``: it is the target's layers, whose all-reduces every rank joins),
handed to the helper ranks as steps are. A sequence on a LoRA adapter is rebuilt with its adapter
(LoRA runs with ``--tp`` 1 only).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBatch
from engine.draft_model import DraftBlocks
from engine.eagle3 import RebuildStep, TargetStates
from engine.model import CausalLM
from engine.parallel.group import RankGroup
from engine.spec.drafter import can_draft
from kvstore.cache import KVCache


class StateRow:
    __slots__ = ("blocks", "done", "start", "states")

    def __init__(self) -> None:
        self.blocks: list[int] = []  # the row's head KV blocks (its block table)
        self.done = 0  # head KV positions below this one were computed from accepted tokens
        self.start = 0  # the position of states[0]
        self.states: torch.Tensor | None = None  # the target's fused states, positions start...

    def keep(self, start: int, states: torch.Tensor) -> None:
        """The states of positions ``start``... (replacing any kept from there on)."""
        have = self.states
        if have is None or not self.start <= start <= self.start + len(have):
            self.start, self.states = start, states  # a gap before them is rebuilt if needed
        else:
            self.states = torch.cat([have[: start - self.start], states])

    def drop_before(self, position: int) -> None:
        if self.states is not None and position > self.start:
            self.states = self.states[position - self.start:]
            self.start = position


class StateDrafter:
    """The common part. A subclass sets ``name``, ``aux_layers`` (what the target keeps), ``head``
    (``head(ids, hidden, positions, attention) -> (normed, pre-norm)`` and ``head.draft(normed)
    -> token ids``; built in its ``load`` before this one's) and ``fuse``."""

    name: str
    aux_layers: tuple[int, ...]

    def __init__(self, device: torch.device, num_blocks: int, block_size: int, backend: str):
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.kv = DraftBlocks(num_blocks, block_size, StateRow)
        self.attention = None  # the subclass's: the head's attention over its own one-layer KV
        self.head = None
        self.target: CausalLM | None = None
        self.lora = None
        self.ranks: RankGroup | None = None
        self.rebuilt_tokens = 0  # target states recomputed for tokens the target did not compute here

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The head's hidden states of the target's kept states ``aux [T, ...]``."""
        raise NotImplementedError

    def load(self, target: CausalLM, target_kv: KVCache, scratch_block: int, lora=None,
             ranks: RankGroup | None = None) -> None:
        """Start on ``target``: the target keeping the states read, and what rebuilding states
        needs (the target's KV, this rank's share of it under ``ranks``, a block its writes go to,
        the engine's ``LoraManager`` if it has one: a rebuild runs base-model rows; and the
        tensor-parallel group whose helper ranks run each rebuild with this one)."""
        self.target = target
        self.lora = lora
        self.ranks = ranks
        target.aux_layers = self.aux_layers
        self.target_states = TargetStates(target, target_kv, self.backend)
        self.scratch_block = scratch_block

    @torch.inference_mode()
    def capture(self, chunks, aux: torch.Tensor) -> None:
        """After a step: ``aux [T, ...]``, the kept states of its tokens (chunks in order); kept
        for rows that may draft, fused."""
        picks, spans, row = [], [], 0
        for c in chunks:
            if can_draft(c.seq):
                picks.extend(range(row, row + c.num_tokens))
                spans.append((c.seq, c.start, c.num_tokens))
            row += c.num_tokens
        if not picks:
            return
        if len(picks) < row:
            aux = aux.index_select(0, torch.tensor(picks, dtype=torch.long, device=aux.device))
        fused = self.fuse(aux)
        at = 0
        for seq, start, n in spans:
            self.kv.row(seq).keep(start, fused[at:at + n])
            at += n

    def propose(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids
        n = len(tokens)
        row = self.kv.row(seq)
        if n < 2 or not self.kv.grow(row, n + k - 2):
            return []
        first = min(row.done, n - 2)  # the last computed position is computed again: it proposes
        with torch.inference_mode():
            hidden = self._states(seq, row, first, n - 1)
            if hidden is None:
                return []
            normed, prenorm = self._step(row, tokens[first + 1:n], hidden, first)
            draft = self.head.draft(normed[-1:])
            drafts = [draft]
            for i in range(1, k):
                normed, prenorm = self._step(row, draft, prenorm[-1:], n - 2 + i)
                draft = self.head.draft(normed)
                drafts.append(draft)
            proposed = torch.cat(drafts).tolist()
        row.done = n - 1
        row.drop_before(n - 2)
        return proposed

    def _step(self, row: StateRow, ids, hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ``ids`` at positions ``start``... (writing their head KV)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        bs, count = self.block_size, ids.shape[0]
        pos = torch.arange(start, start + count, device=self.device)
        table = torch.as_tensor(row.blocks, dtype=torch.long, device=self.device)
        slots = table[pos // bs] * bs + pos % bs
        self.attention.plan(AttentionBatch([count], [start + count], [row.blocks], slots))
        return self.head(ids, hidden, pos, self.attention)

    def _states(self, seq, row: StateRow, first: int, end: int) -> torch.Tensor | None:
        """The target's fused states of positions ``first`` to ``end`` (excluded): those kept,
        the ones missing before them rebuilt."""
        have = row.states
        if have is None or row.start + len(have) < end or row.start > end:
            return self._rebuild(seq, first, end)
        kept = have[max(first - row.start, 0): end - row.start]
        if row.start <= first:
            return kept
        rebuilt = self._rebuild(seq, first, row.start)
        return None if rebuilt is None else torch.cat([rebuilt, kept])

    @torch.inference_mode()
    def _rebuild(self, seq, first: int, end: int) -> torch.Tensor | None:
        """The target's fused states of positions ``first`` to ``end``, recomputed: its layers up
        to the last one read over those tokens, attending to the KV in the sequence's blocks.
        A sequence on a LoRA adapter runs its rows with the adapter, brought into a slot as a step
        would (its states are the adapted target's, as the ones captured for it)."""
        if self.lora is not None:  # the runner activates and plans each step again
            self.lora.plan([end - first], self.lora.activate([seq.lora]))
        step = RebuildStep.of(seq.token_ids[:end], first, seq.block_table, self.block_size, self.scratch_block,
                              self.aux_layers)
        if self.ranks is None:
            aux = self.target_states(step)
        else:
            self.ranks.broadcast(step)  # the helper ranks run it with us (their shares of the heads)
            try:
                aux = self.target_states(step)
            except Exception as e:  # the ranks may be out of step: as a failed step does
                self.ranks.abort(f"{self.name} rebuild: {type(e).__name__}: {e}")
                raise
        self.rebuilt_tokens += end - first
        return self.fuse(aux)
