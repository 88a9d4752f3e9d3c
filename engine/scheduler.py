"""Continuous batching: which sequences compute how many tokens this step.

One token budget per step. Running sequences go first (a decode takes one token, a half-prefilled
prompt takes the next chunk), then waiting ones are admitted in order with their prefix-cache hits
(in any KV tier: hits below the device are onboarded into fresh device blocks at admission, and
admission counts those blocks). When blocks run out, the most recently admitted running sequence is
preempted by recompute: its blocks are freed (they stay cached, or are offloaded, so the recompute
is mostly a prefix hit) and it goes back to the front of the queue (``before_preempt``, where set,
hears of it first: steps in flight hold a victim's blocks while a step still writes them).

Priority (higher first; interactive traffic 0, batch below): the queue and the running set are
ordered by priority, then arrival. A waiting sequence that does not fit preempts lower-priority
running ones, and while any higher-priority sequence is running or waiting, lower-priority ones are
paused (they keep their blocks but skip steps), so an interactive request never shares a step with
a flood of batch work. The lowest priority, most recent sequence is always the first victim.

The scheduler never touches tensors; ``SchedulerOutput`` is a plain value the runner executes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sequence import SampledToken, SeqStatus, Sequence
from engine.spec.adaptive import AcceptancePrior
from engine.spec.drafter import Drafter, SpecCounters, can_draft
from kvstore.manager import KVCacheManager

FINISHED = SeqStatus.FINISHED_STOPPED  # status >= FINISHED: finished


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_loras: int = 0  # distinct LoRA adapters the running set may hold (one step runs them all); 0: off
    num_speculative_tokens: int = 0  # drafted tokens a decoding row verifies per step (with a drafter)
    spec_adaptive: bool = True  # K adapts per row to its acceptance (engine.spec.adaptive); False: fixed K
    # Stall-free batching (Sarathi-Serve): at most this many prompt tokens in a step that also
    # decodes, so a burst of admissions never stretches every stream's next token past ~one
    # step; a step with no decoding row takes the whole budget. 0: no cap.
    max_prefill_with_decode: int = 0


@dataclass(slots=True)  # never changed once made; not frozen: one per row per step (a frozen __init__ is slower)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    # The chunk reaches the end of the sequence's tokens (in-flight ones included), so its last
    # row yields the next token. Fixed when scheduled: the sequence moves on before the step resolves.
    samples: bool
    # Speculative decoding: the tokens drafted after the sequence's last one. The chunk computes
    # that token and them (1 + len(drafts) positions), and its sampled token carries the accepted ones.
    drafts: list[int] | tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """The next ``num_tokens`` positions of ``seq``."""
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens + seq.num_placeholders)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]


@dataclass(slots=True)  # never changed once made; not frozen: one per request per step
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list  # TokenLogprob per new token when logprobs were asked
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: dict[str, Sequence] = {}  # WAITING_FOR_KV: a prefill worker writes their blocks
        self.held: dict[str, Sequence] = {}  # finished, blocks kept until the caller releases them
        self.num_preemptions = 0
        self.drafter: Drafter | None = None  # speculative decoding: proposes tokens for decoding rows
        self.spec = SpecCounters()
        self.before_preempt: Callable[[Sequence], None] | None = None  # each victim, before its free

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self._drafter = drafter
        self.spec_prior = AcceptancePrior(self.config.spec_adaptive)  # another drafter: its acceptance is not known yet

    # -- queue management ---------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the queue by priority; ``front``: ahead of its peers (a preempted or requeued one)."""
        for i, other in enumerate(self.waiting):
            if other.priority < seq.priority or (front and other.priority == seq.priority):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def _run(self, seq: Sequence) -> None:
        """Into the running set, after every sequence of its priority or higher."""
        for i, other in enumerate(self.running):
            if other.priority < seq.priority:
                self.running.insert(i, seq)
                return
        self.running.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return self.remote.get(request_id) or self.held.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.find(request_id)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.remote.pop(request_id, None)
        self.held.pop(request_id, None)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED_ABORTED
        return seq

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------
    def schedule(self, busy: set[Sequence] | tuple = (), most: int | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._make_room_for(out, budget)
        top = max(self.waiting[0].priority if self.waiting else -(1 << 62),
                  self.running[0].priority if self.running else -(1 << 62))
        i = 0
        pressure = False
        chunks = out.chunks
        running = self.running
        bs = self.kv.block_size
        prefill = -1  # prompt tokens this step may still take (-1: not worked out yet)
        drafting = self._drafter is not None
        while i < len(running) and budget > 0 and (most is None or len(chunks) < most):  # (engine.inflight)
            seq = running[i]
            if seq.priority < top:
                break  # paused while higher-priority work exists (the rest rank lower still)
            if (busy and seq in busy) or (seq.num_placeholders and self._stops_by_length(seq)):
                i += 1  # in a step in flight (``busy``), or its in-flight token is its last: nothing to compute
                continue
            start = seq.num_computed_tokens
            end = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_placeholders
            n = min(end - start, budget)
            if n > 1:  # the next chunk of a prompt
                if prefill < 0:
                    prefill = self._prefill_room(budget)
                n = min(n, prefill)
                if n == 0:
                    i += 1  # its prompt waits for a step with room
                    continue
                prefill -= n
            drafts = self._draft(seq, budget) if n == 1 and drafting else ()
            if drafts and self.kv.grow(seq, 1 + len(drafts)):  # no room for them: no drafts
                chunks.append(ScheduledChunk(seq, start, 1 + len(drafts), True, drafts))
                budget -= 1 + len(drafts)
                i += 1
                continue
            # most rows: one decode token inside the last block (no growth, no pool call)
            if start + n <= len(seq.block_table) * bs or self._grow_or_preempt(seq, n, out):
                chunks.append(ScheduledChunk(seq, start, n, start + n == end))
                budget -= n
                i += 1
            else:
                pressure = True
        if not pressure and self.waiting:
            self._admit(out, min(budget, self._prefill_room(budget) if prefill < 0 else prefill), top)
        return out

    def _prefill_room(self, budget: int) -> int:
        """Prompt tokens a step may take: ``max_prefill_with_decode`` when a running sequence is
        decoding (its prompt computed), else the whole budget."""
        cap = self.config.max_prefill_with_decode
        if cap <= 0 or cap >= budget:
            return budget
        return cap if any(s.output_token_ids or s.num_placeholders for s in self.running) else budget

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Tokens drafted after a decoding row's last one: as many as the step's budget, the row's
        ``max_tokens`` and the context leave room for (none for a row that cannot draft)."""
        if not can_draft(seq):
            return []
        if seq.draft_length is None:
            seq.draft_length = self.spec_prior.start(self.config.num_speculative_tokens, len(self.running))
        k = seq.draft_length.next()  # counts the steps of a row at 0 even while its token is in flight
        if not k or seq.num_placeholders or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        k = min(k, budget - 1,
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.config.max_model_len - seq.num_tokens - 1)
        drafts = self._drafter.propose(seq, k)[:k] if k > 0 else []
        # a grammar cuts them at the first token it refuses
        return drafts[:seq.grammar.draft_prefix(drafts)] if drafts and seq.grammar is not None else drafts

    def _make_room_for(self, out: SchedulerOutput, budget: int) -> None:
        """Preempt lower-priority running sequences until the head of the queue fits."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        while self.running and self.running[-1].priority < head.priority and not self._fits(head, budget):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)

    def _fits(self, seq: Sequence, budget: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        hit = self.kv.match_prefix(seq)
        n = min(seq.num_tokens - len(hit) * self.kv.block_size, budget)
        return self.kv.can_admit(seq, hit, n)

    def _grow_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.grow(seq, n):
            victim = self.running.pop()  # the lowest priority, most recently admitted
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.before_preempt is not None:
            self.before_preempt(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)

    def _admit(self, out: SchedulerOutput, budget: int, top: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.priority < top:
                break  # lower-priority work waits until the higher-priority work is done
            if seq.num_placeholders:
                break  # preempted this step while its last token was in flight: back once it is known
            if not self._lora_fits(seq):
                break  # its adapter needs a slot: it waits until a running adapter's requests finish
            n = self._take_blocks(seq, budget)
            if n is None:
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            self._run(seq)
            out.chunks.append(ScheduledChunk.of(seq, n))
            budget -= n

    def _lora_fits(self, seq: Sequence) -> bool:
        """Can ``seq`` join without more distinct LoRA adapters running than the engine has slots?"""
        if seq.lora is None or not self.config.max_loras:
            return True
        active = {id(s.lora) for s in (*self.running, *self.remote.values()) if s.lora is not None}
        return id(seq.lora) in active or len(active) < self.config.max_loras

    def _take_blocks(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence its prefix hit (onboarding hits below the device) and blocks for
        up to ``budget`` more tokens; how many tokens it computes next, or None (no room, nothing taken)."""
        hit = self.kv.match_prefix(seq)
        n = min(seq.num_tokens - len(hit) * self.kv.block_size, budget)
        if not self.kv.can_admit(seq, hit, n):
            return None
        self.kv.admit(seq, hit)
        # the hit may have come back shorter (a lower-tier block failed its check): more to compute
        n = min(seq.num_uncomputed_tokens, budget)
        if not self.kv.grow(seq, n):
            # rare: the cut hit shared fewer blocks than counted; retry next step with the shorter hit
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            return None
        return n

    # -- remote prefill (decode side of disaggregation) ----------------------
    def reserve_remote(self, seq: Sequence) -> bool:
        """Allocate a new sequence's prompt blocks for a prefill worker to fill; False if they do not fit."""
        if not self._lora_fits(seq) or self._take_blocks(seq, seq.num_tokens) is None:
            return False
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SeqStatus.WAITING_FOR_KV
        self.remote[seq.request_id] = seq
        return True

    def complete_remote(self, request_id: str, first: SampledToken) -> StepOutput | None:
        """The prefill worker wrote every prompt block and sampled the first token."""
        seq = self.remote.pop(request_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed(seq)
        taken = self.take_token(seq, first)
        if seq.is_finished:
            self.retire(seq)
        else:
            seq.status = SeqStatus.RUNNING
            self._run(seq)
        return self.output_of(seq, first if taken else None)

    def fail_remote(self, request_id: str) -> Sequence | None:
        """No KV came: drop the promised blocks and prefill locally, ahead of newer requests."""
        seq = self.remote.pop(request_id, None)
        if seq is None:
            return None
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        return seq

    def update(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[StepOutput]:
        """Advance the scheduled sequences; ``sampled`` aligns with ``out.sampling_chunks``."""
        self.advance(out)
        return self.resolve(out, sampled)

    # Overlapped scheduling splits ``update`` in two: ``advance`` right after a step is launched
    # (its tokens are placeholders until then), ``resolve`` once its sampled tokens reach the host,
    # which is after the next step was scheduled and launched.

    def advance(self, out: SchedulerOutput) -> None:
        """The step's positions are computed (or being computed); its samples are in flight."""
        bs = self.kv.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            if seq.num_computed_tokens // bs > seq.num_cached_blocks:  # a block filled up: name it
                self.kv.cache_computed(seq)
            if chunk.samples:
                seq.num_placeholders += 1

    def resolve(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[StepOutput]:
        """The step's sampled tokens replace its placeholders: stops, finishes, outputs.

        A sequence that finished meanwhile (aborted, or stopped by the token before) drops its
        token; one preempted while its token was in flight keeps it, as it would have without
        overlap (it was sampled from the full context).
        """
        results: list[StepOutput] = []
        finished: list[Sequence] = []
        samples = iter(sampled)
        bs = self.kv.block_size
        for chunk in out.chunks:
            if not chunk.samples:
                continue
            tok = next(samples)
            seq = chunk.seq
            seq.num_placeholders -= 1
            if seq.status >= FINISHED:
                continue
            if not self.take_token(seq, tok):
                tok = None
            elif chunk.drafts:
                tok = self._take_verified(seq, chunk, tok)
            if seq.num_computed_tokens // bs > seq.num_cached_blocks:
                self.kv.cache_computed(seq)  # a block whose last token was in flight gets its name now
            if seq.status >= FINISHED:
                finished.append(seq)
            results.append(self.output_of(seq, tok))
        for seq in finished:
            if seq in self.running:
                self.running.remove(seq)
            else:  # preempted while its last token was in flight
                self.waiting.remove(seq)
            self.retire(seq)
        return results

    def _take_verified(self, seq: Sequence, chunk: ScheduledChunk, tok: SampledToken) -> SampledToken:
        """After a drafting row's first token, the accepted ones join until one ends the sequence;
        the rejected drafts' positions are rolled back (computed again later, their blocks freed).
        The token, with ``then`` cut to what joined."""
        taken, lps = 0, tok.then_logprobs
        for t in tok.then:  # verified under the row's grammar masks where it has one: always taken
            if seq.status >= FINISHED:
                break
            self.take_token(seq, SampledToken(t, lps[taken] if lps else None))
            taken += 1
        self.spec.count(len(chunk.drafts), len(tok.then), 1 + taken)
        self.spec_prior.observe(len(chunk.drafts), len(tok.then))
        seq.draft_length.update(len(chunk.drafts), len(tok.then), self.config.num_speculative_tokens)
        # the step computed the last token and the drafts; valid KV: every token but the last emitted
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv.shrink(seq, seq.num_tokens)
        if taken == len(tok.then):
            return tok
        return SampledToken(tok.token_id, tok.logprob, tok.then[:taken], tok.then_logprobs[:taken])

    def _stops_by_length(self, seq: Sequence) -> bool:
        """Its in-flight tokens take it to ``max_tokens`` or the context limit."""
        return (seq.num_output_tokens_scheduled >= seq.params.max_tokens
                or seq.num_tokens + seq.num_placeholders >= self.config.max_model_len)

    # take_token, check_stop and output_of run once per row per step: they read the sequence's
    # lists directly rather than through its properties (python -m bench host-overhead).

    def take_token(self, seq: Sequence, tok: SampledToken) -> bool:
        """A sampled token joins the sequence (and its grammar), then the stop conditions are checked.
        False if the sequence ended without it: its grammar process found the grammar complete, or
        broken, after the token before (GrammarState.verdict)."""
        grammar = seq.grammar
        if grammar is not None and grammar.verdict:
            seq.status = SeqStatus.FINISHED_ERROR if grammar.error else SeqStatus.FINISHED_STOPPED
            return False
        seq.output_token_ids.append(tok.token_id)
        if tok.logprob is not None:
            seq.output_logprobs.append(tok.logprob)
        # no replica in a grammar process yet (epoch 0), or drafts to check from the state after
        # every token: the engine's own matcher checks the token
        if grammar is not None and (not grammar.epoch or self._drafter is not None) and not grammar.advance(tok.token_id):
            seq.status = SeqStatus.FINISHED_ERROR  # unmasked sampling, or a grammar engine bug
        else:
            self.check_stop(seq)
        return True

    def check_stop(self, seq: Sequence) -> None:
        p = seq.params
        outs = seq.output_token_ids
        n_out = len(outs)
        last = outs[-1] if n_out else seq.prompt_token_ids[-1]
        if ((not p.ignore_eos and last in self.config.eos_token_ids) or last in p.stop_token_ids) \
                and n_out >= p.min_tokens:
            seq.status = SeqStatus.FINISHED_STOPPED
        elif seq.grammar is not None and seq.grammar.is_done:
            seq.status = SeqStatus.FINISHED_STOPPED  # the output is complete: only EOS could follow
        elif n_out >= p.max_tokens or len(seq.prompt_token_ids) + n_out >= self.config.max_model_len:
            seq.status = SeqStatus.FINISHED_LENGTH

    def retire(self, seq: Sequence) -> None:
        """A finished sequence gives its blocks back, unless its owner asked to hold them."""
        if seq.hold_blocks:
            self.held[seq.request_id] = seq
        else:
            self.kv.free(seq)

    def release(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    @staticmethod
    def output_of(seq: Sequence, tok: SampledToken | None) -> StepOutput:
        """What a step that sampled ``tok`` for ``seq`` (taken; None: not taken) produced for its request."""
        if tok is None:
            ids, logprobs = [], []
        else:
            ids = [tok.token_id, *tok.then]
            logprobs = [] if tok.logprob is None else [tok.logprob, *tok.then_logprobs]
        return StepOutput(seq.request_id, ids, logprobs, seq.status.finish_reason, len(seq.prompt_token_ids),
                          seq.num_cached_tokens, len(seq.output_token_ids))
