"""One request's state inside an engine: tokens, progress, blocks, status.

Counters are stored (``num_computed_tokens``); everything else is derived.

Overlapped scheduling (``engine.overlap``) schedules a step before the
previous one's tokens are known: ``num_placeholders`` counts the output tokens
that in-flight steps are sampling. They take positions (the scheduler computes
them next, from the token on the device) but are not in ``output_token_ids``
until the step resolves, so everything the rest of the worker reads (tokens,
counts, hashes) holds only real tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams
from kvstore.hashing import HashSeed, chain_hashes

if TYPE_CHECKING:
    from engine.constraints.state import GrammarState
    from engine.lora_adapter import LoraAdapter
    from engine.spec.adaptive import DraftLength


class SeqStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0
    WAITING_FOR_KV = 1  # blocks allocated; a prefill worker is writing them
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the engine could not go on with it (a token its grammar rejects)

    @property
    def is_finished(self) -> bool:
        return self >= SeqStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_ABORTED: "abort",
    SeqStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (token id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)  # not frozen: one per row per step, and a frozen __init__ costs twice as much
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
    # Speculative decoding: the tokens the same step emitted after this one (accepted drafts'
    # verified successors), in order; () for a row that drafted nothing or accepted no draft.
    then: tuple[int, ...] = ()
    then_logprobs: tuple[TokenLogprob, ...] = ()  # theirs, where logprobs were asked


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    hash_seed: HashSeed  # model, cache scope (tenant, salt) and LoRA adapter under the mesh's key
    arrival: float = 0.0
    priority: int = 0
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_placeholders: int = 0  # output tokens in-flight steps are sampling (overlapped scheduling)
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table already named in the cache
    num_preemptions: int = 0
    hold_blocks: bool = False  # keep the blocks after finishing until released (prefill → transfer)
    # Migrated requests: the last ``output_offset`` prompt tokens were generated elsewhere before.
    # Seeded sampling continues at that index and penalties count them as outputs.
    output_offset: int = 0
    # The LoRA adapter the request runs (part of ``hash_seed``); None: the base model
    lora: LoraAdapter | None = None
    # A constrained request's place in its grammar (params.constraint), set when the engine adds it.
    grammar: GrammarState | None = field(default=None, repr=False)
    # Speculative decoding: how many tokens the row drafts next (engine.spec.adaptive), set when it first drafts.
    draft_length: DraftLength | None = field(default=None, repr=False)
    _hashes: list[int] = field(default_factory=list, repr=False)
    _chain_state: bytes | None = field(default=None, repr=False)  # the hash chain after _hashes[-1]

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")

    # -- derived ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Positions still to compute, the in-flight tokens' included (the scheduler's view)."""
        return self.num_tokens + self.num_placeholders - self.num_computed_tokens

    @property
    def num_output_tokens_scheduled(self) -> int:
        """Output tokens once every in-flight step resolved (the sampler's index of the next one)."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def is_prefilling(self) -> bool:
        """True until the whole known sequence (prompt, or prompt + outputs after a preemption) is computed
        up to its last token."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def block_hashes(self, num_blocks: int | None = None) -> list[int]:
        """Chained hashes of the first ``num_blocks`` full blocks (all full blocks by default)."""
        full = self.num_tokens // self.block_size
        want = full if num_blocks is None else min(num_blocks, full)
        have = len(self._hashes)
        if want > have:
            names, self._chain_state = chain_hashes(
                self.tokens_between(have * self.block_size, want * self.block_size),
                self.block_size,
                self.hash_seed,
                self._chain_state,
            )
            self._hashes.extend(names)
        return self._hashes[:want]

    @property
    def generated_token_ids(self) -> list[int]:
        """Every output token of the request, including those generated before a migration."""
        if not self.output_offset:
            return self.output_token_ids
        return self.prompt_token_ids[-self.output_offset :] + self.output_token_ids

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
