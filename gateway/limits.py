"""How much the gateway takes in: sizes that follow what it serves and what it admits.

    body_cap(max_model_len)            request bodies: 1 MiB + 16 bytes per token of the largest
                                       context served (a full-context prompt as JSON token ids is
                                       ~7 bytes a token, as text ~4, escaped non-ASCII up to ~12)
    reply_buffer_limits(max_inflight)  the reply subscription (every stream's token chunks): what
                                       ``max_inflight`` admitted streams may have waiting at once
"""

from __future__ import annotations

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
