"""How much the gateway takes in: sizes that follow what it serves and what it admits.

    body_cap(max_model_len)            request bodies: 1 MiB + 16 bytes per token of the largest
                                       context served (a full-context prompt as JSON token ids is
                                       ~7 bytes a token, as text ~4, escaped non-ASCII up to ~12)
    reply_buffer_limits(max_inflight)  the reply subscription (every stream's token chunks): what
                                       ``max_inflight`` admitted streams may have waiting at once
    BatchConfig                        the Batch API's files, queued lines and pacing
"""

from __future__ import annotations

from dataclasses import dataclass

BODY_FLOOR = 1 << 20  # bytes of request besides the prompt (messages, options); the cap before any worker
BYTES_PER_TOKEN = 16
STREAM_MSGS = 1024  # chunks one stream may have waiting for its reader
STREAM_BYTES = 256 << 10  # bytes of them (a chunk with top logprobs is a few hundred bytes a token)


def body_cap(max_model_len: int) -> int:
    return BODY_FLOOR + BYTES_PER_TOKEN * max(0, max_model_len)


def reply_buffer_limits(max_inflight: int) -> tuple[int, int]:
    """(messages, bytes) the reply subscription may hold before NATS drops (a slow consumer): a
    stream that loses a chunk ends with a clear 502 instead of the gateway's memory growing."""
    n = max(1, max_inflight)
    return n * STREAM_MSGS, n * STREAM_BYTES


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API's limits and pacing (``mesh gateway`` flags, docs/operations.md). Here, not in
    ``gateway.batches``: ``GatewayConfig`` holds it, and the core imports no API's package."""

    max_files: int = 100  # --batch-max-files: batch input files a tenant may keep
    max_file_bytes: int = 200 << 20  # --batch-max-file-bytes: one file's size, and a tenant's total
    max_queued_requests: int = 50_000  # --batch-max-queued-requests: lines of a tenant's unfinished batches
    max_inflight: int = 32  # --batch-max-inflight: lines one gateway runs at once, at most
    headroom: float = 0.25  # --batch-headroom: the share of worker capacity batch lines leave free
    lease_s: float = 15.0  # --batch-lease: a dead gateway's batches are taken over after this
    line_timeout: float = 600.0  # seconds one line may take

    def __post_init__(self) -> None:
        if min(self.max_files, self.max_file_bytes, self.max_queued_requests, self.max_inflight) < 1:
            raise ValueError("the --batch-max-* limits must be >= 1")
        if self.lease_s <= 0 or self.line_timeout <= 0 or not 0.0 <= self.headroom < 1.0:
            raise ValueError("need --batch-lease > 0 and 0 <= --batch-headroom < 1")
