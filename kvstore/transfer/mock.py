"""``mock``: for mocker workers, which have no KV bytes. The sender sleeps for
the time the transfer would take at a nominal bandwidth; the receiver has
nothing to do. The coordination messages are the real ones.
"""

from __future__ import annotations

import asyncio
import time

from kvstore.transfer import TransferResult, TransferTarget, register_receiver, register_sender

BYTES_PER_TOKEN = 128 * 1024  # an 8B model's KV: 32 layers x 8 heads x 128 dims x 2 x 2 bytes
BANDWIDTH = 25e9  # bytes/s (a fast NIC)


@register_receiver("mock")
class MockReceiver:
    name = "mock"

    def __init__(self, **_):
        pass

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        return {"blocks": len(dest_blocks)}

    async def finish(self, request_id: str) -> bool:
        return True

    def forget(self, request_id: str) -> None:
        pass

    def revoke(self, request_id: str) -> bool:
        return True  # nothing is ever written


@register_sender("mock")
class MockSender:
    name = "mock"

    def __init__(self, speedup: float = 1.0, **_):
        self.speedup = speedup

    def usable(self, params: dict) -> bool:
        return "blocks" in params

    async def send(self, target: TransferTarget, params: dict, src, src_blocks: list[int]) -> TransferResult:
        nbytes = len(target.dest_block_ids) * target.block_size * BYTES_PER_TOKEN
        seconds = nbytes / BANDWIDTH / self.speedup
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        return TransferResult(self.name, nbytes, time.perf_counter() - t0)
