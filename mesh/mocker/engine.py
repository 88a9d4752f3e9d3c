"""``MockEngine``: ``EngineCore`` with a timing model instead of a model.

Every step is scheduled by the real scheduler over the real block pool and
prefix cache, then "executed" by sleeping for what the step would take on a
GPU (prefill cost per token, decode cost per step, per sequence and per KV
token), divided by ``speedup``. Tokens are a deterministic function of the
sequence, so outputs are reproducible. No torch: a mock worker is a cheap
process, and dozens run on two cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mesh.engine.core import CoreConfig, EngineCore
from mesh.engine.scheduler import SchedulerOutput
from mesh.engine.sequence import SampledToken, Sequence


@dataclass(frozen=True)
class TimingModel:
    """Milliseconds, roughly an 8B model on one H100."""

    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = 0.06
    prefill_ms_per_token_ctx: float = 2e-7  # attention: grows with tokens x context
    decode_base_ms: float = 8.0
    decode_ms_per_seq: float = 0.06
    decode_ms_per_kv_token: float = 2e-5

    def step_ms(self, out: SchedulerOutput) -> float:
        ms = 0.0
        decodes = 0
        kv_tokens = 0
        for c in out.chunks:
            if c.num_tokens == 1 and c.start > 0:
                decodes += 1
                kv_tokens += c.end
            else:
                ms += (
                    self.prefill_base_ms
                    + self.prefill_ms_per_token * c.num_tokens
                    + self.prefill_ms_per_token_ctx * c.num_tokens * c.end
                )
        if decodes:
            ms += self.decode_base_ms + self.decode_ms_per_seq * decodes + self.decode_ms_per_kv_token * kv_tokens
        return ms


@dataclass(frozen=True)
class MockConfig:
    model_name: str = "mock"
    vocab_size: int = 32000
    block_size: int = 16
    num_blocks: int = 16384
    max_model_len: int = 131072
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup: float = 1.0
    timing: TimingModel = TimingModel()
    host_kv_blocks: int = 0  # a virtual host tier: bookkeeping and KV events, no bytes, no copy time

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.host_kv_blocks < 0:
            raise ValueError(f"host_kv_blocks must be >= 0, got {self.host_kv_blocks}")


class MockEngine(EngineCore):
    def __init__(self, config: MockConfig):
        self.config = config
        super().__init__(
            CoreConfig(
                model_name=config.model_name,
                vocab_size=config.vocab_size,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        )
        if config.host_kv_blocks:
            self.enable_tiers(config.host_kv_blocks)
        self.simulated_seconds = 0.0

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        seconds = self.config.timing.step_ms(out) / 1000.0 / self.config.speedup
        self.simulated_seconds += seconds
        if seconds > 0:
            time.sleep(seconds)
        vocab = self.vocab_size
        tokens = []
        for c in out.chunks:
            if c.samples:  # token_for, written out (one per row per step)
                seq = c.seq
                n_out = len(seq.output_token_ids)
                last = seq.output_token_ids[-1] if n_out else seq.prompt_token_ids[-1]
                tokens.append(SampledToken((last * 31 + (len(seq.prompt_token_ids) + n_out) * 17 + 7) % vocab))
        return tokens

    def token_for(self, seq: Sequence) -> int:
        """The next token: a fixed function of the last token and the length."""
        return (seq.last_token_id * 31 + seq.num_tokens * 17 + 7) % self.vocab_size
