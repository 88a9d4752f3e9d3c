"""One sequence's place in its grammar.

``GrammarState`` advances with every token the sequence accepts, wherever that
token was sampled: the scheduler calls ``advance`` for a decoded token and for
the first token a prefill worker sent. A sequence that arrives with tokens
already generated (migration, a disaggregated first token, a rebuilt
request) replays them through the same ``advance`` when it is attached, so a
rebuilt state is the state an uninterrupted run would have. Preemption keeps
the state: recompute re-reads tokens, it does not re-accept them.

While ``start_after`` is pending (a reasoning model's thinking block) the
output is free and no mask is computed; the grammar starts with the token
after it.

``needs_mask`` and ``is_done`` are plain attributes, set when a token is taken:
the engine reads them for every constrained row of every step, and asking the
matcher each time was a native call per read.

Where a grammar process fills the masks (replica.py), the engine's matcher checks only the tokens
it did not sample under its own masks: those replayed when the state is attached and a prefill
worker's first token (until the state's replica is made: ``epoch`` 0). The tokens sampled under the
masks the replica checks, and its verdict (the grammar is complete, or broke) comes back with the
next step's masks: the manager sets ``verdict`` (and ``is_done`` or ``error``), and the scheduler
ends the sequence there, without that step's token. A constrained sequence so ends one step later
than it would with the engine checking each token, the same tokens out; the engine thread saves a
matcher call per row per step (python -m bench structured). An engine that drafts (speculative decoding)
has its own matcher take every token: the drafts are checked and masked from the state after the
sequence's tokens (``draft_prefix``, ``fill_drafted``), in the engine thread.
"""

from __future__ import annotations

from engine.constraints.backend import TokenMatcher


class GrammarState:
    __slots__ = ("__weakref__", "epoch", "error", "is_done", "key", "matcher", "needs_mask", "num_tokens", "sent",
                 "start_after", "started", "verdict")

    def __init__(self, matcher: TokenMatcher, start_after: int | None = None):
        self.matcher = matcher
        self.start_after = start_after
        self.started = start_after is None
        self.num_tokens = 0  # generated tokens this matcher saw (before and after the start)
        self.error = ""
        self.is_done = False  # the grammar is complete: the sequence ends here (finish reason ``stop``)
        self.needs_mask = False  # the next token is constrained
        self.verdict = False  # the grammar process found it complete (is_done) or broken (error): it ends
        # the grammar process's replica (replica.py): its key, the process it lives in, the tokens it took
        self.key = 0
        self.epoch = 0  # 0: none yet, and the scheduler checks each token taken against this matcher
        self.sent = 0
        self._settle()

    def advance(self, token_id: int) -> bool:
        """Take one generated token; False if the grammar rejects it (``error`` says why)."""
        self.num_tokens += 1
        if not self.started:
            if token_id == self.start_after:
                self.started = True
                self._settle()
            return True
        if self.error:
            return False
        if not self.matcher.consume(token_id):
            self.error = self.matcher.error or f"token {token_id} does not match the grammar"
            self.is_done = self.needs_mask = False
            return False
        self._settle()
        return True

    # Speculative decoding: drafts are walked through the matcher and rolled back at once, so the
    # matcher is always at the tokens the sequence took; the accepted ones are taken as usual.

    def draft_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` (tokens proposed after the sequence's) the grammar takes in order;
        the matcher is left where it was. Before the grammar starts: the drafts before the token
        that starts it (free positions, no masks)."""
        if not self.started:
            return drafts.index(self.start_after) if self.start_after in drafts else len(drafts)
        if self.error or self.verdict or not self.needs_mask:
            return 0
        m, n = self.matcher, 0
        for t in drafts:  # up to the one that completes the grammar: the sequence ends there
            if m.try_consume([t]) != 1:
                break
            n += 1
            if m.is_done:
                break
        m.rollback(n)
        return n

    def fill_drafted(self, fill, drafts: list[int], bitmask, row: int) -> None:
        """The masks of a drafting row's positions into ``bitmask[row:row + len(drafts) + 1]``: the
        state after its tokens, then after each draft (``draft_prefix`` kept only drafts it takes).
        ``fill``: the backend's. The matcher is left where it was. A draft that completes the grammar
        ends the sequence, so the position after it allows every token (its target is never taken;
        a terminated matcher has no mask to give)."""
        m = self.matcher
        fill([(m, row)], bitmask)
        taken = 0
        try:
            for t in drafts:
                if m.try_consume([t]) != 1:
                    raise RuntimeError(f"draft token {t} does not match the grammar (not cut by draft_prefix)")
                taken += 1
                if m.is_done:
                    bitmask[row + taken] = -1
                else:
                    fill([(m, row + taken)], bitmask)
        finally:
            m.rollback(taken)

    def replay(self, token_ids: list[int]) -> bool:
        return all(self.advance(t) for t in token_ids)

    def settle_late(self, error: str) -> None:
        """The grammar process's verdict on the tokens so far: complete (``error`` empty) or broken."""
        self.verdict = True
        self.error = error
        self.is_done = not error
        self.needs_mask = False

    def _settle(self) -> None:
        if self.started:
            self.is_done = self.matcher.is_done
            self.needs_mask = not self.is_done
