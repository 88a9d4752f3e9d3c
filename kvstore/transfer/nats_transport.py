"""``nats``: CPU, any host. The KV bytes travel as ``KvChunk`` messages under
the server's max_payload to a per-request subject of the decode worker.

Flow control: every few megabytes the sender makes a chunk a request and waits
for the receiver's reply, so at most one window is in flight and a slow
decode worker is never cut off as a slow consumer. The last chunk is always a
request: when ``send`` returns, the receiver holds every byte.

Tensor parallelism needs nothing here: a TP worker's cache is a ``ShardedKVCache``,
whose block-major bytes are always the full head set (gathered from the sender's
ranks, split over the receiver's), so the two sides' TP degrees may differ.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from kvstore.cache import KVCache
from kvstore.transfer import TransferResult, TransferTarget, register_receiver, register_sender
from kvstore.transfer.messages import KvChunk
from kvstore.transfer.messenger import Messenger

log = logging.getLogger(__name__)

WINDOW_BYTES = 8 << 20
HEADROOM = 4096  # room for the message envelope under max_payload


@dataclass
class _Assembly:
    dest_blocks: list[int]
    total: int
    buf: bytearray | None = None
    received: int = 0
    indexes: set[int] = field(default_factory=set)


@register_receiver("nats")
class NatsReceiver:
    name = "nats"

    def __init__(self, kv: KVCache, bus: Messenger, model: str, worker_id: str, **_):
        self.kv = kv
        self.bus = bus
        self.model = model
        self.worker_id = worker_id
        self._pending: dict[str, _Assembly] = {}
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(
            self.bus.subjects.kv_data_all(self.model, self.worker_id), self._on_chunk, KvChunk,
            pending_msgs_limit=1 << 20,
        )

    def params(self, request_id: str, dest_blocks: list[int]) -> dict:
        total = len(dest_blocks) * self.kv.spec.block_bytes
        self._pending[request_id] = _Assembly(list(dest_blocks), total)
        return {"subject": self.bus.subjects.kv_data(self.model, self.worker_id, request_id), "bytes": total}

    async def _on_chunk(self, chunk: KvChunk, raw) -> None:
        asm = self._pending.get(chunk.request_id)
        if asm is None:
            return  # cancelled or timed out: late bytes go nowhere
        end = chunk.offset + len(chunk.data)
        if chunk.total_bytes != asm.total or chunk.offset < 0 or end > asm.total:
            log.warning("dropping a KV chunk of %s that does not fit its blocks", chunk.request_id)
        elif chunk.index not in asm.indexes:
            if asm.buf is None:
                asm.buf = bytearray(asm.total)
            asm.buf[chunk.offset : end] = chunk.data
            asm.indexes.add(chunk.index)
            asm.received += len(chunk.data)
        if raw.reply:
            await raw.respond(b"")

    async def finish(self, request_id: str) -> bool:
        """Write the assembled bytes into the destination blocks; False if some are missing."""
        asm = self._pending.pop(request_id, None)
        if asm is None or asm.received != asm.total or asm.buf is None:
            return False
        spec = self.kv.spec
        n = len(asm.dest_blocks)
        data = torch.frombuffer(asm.buf, dtype=torch.uint8).view(spec.dtype)
        data = data.view(n, *spec.block_shape)
        await asyncio.to_thread(self.kv.write_block_major, asm.dest_blocks, data)
        return True

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def revoke(self, request_id: str) -> bool:
        """Bytes are written here, by ``finish``: once forgotten, late ones go nowhere."""
        self.forget(request_id)
        return True


@register_sender("nats")
class NatsSender:
    name = "nats"

    def __init__(self, bus: Messenger, **_):
        self.bus = bus

    def usable(self, params: dict) -> bool:
        return bool(params.get("subject"))

    async def send(self, target: TransferTarget, params: dict, src: KVCache, src_blocks: list[int]) -> TransferResult:
        t0 = time.perf_counter()
        blocks = await asyncio.to_thread(lambda: src.read_block_major(src_blocks).cpu())
        payload = memoryview(blocks.view(-1).view(torch.uint8).numpy())
        return await self.send_bytes(target.request_id, params, payload, t0)

    async def send_bytes(self, request_id: str, params: dict, payload: memoryview,
                         t0: float | None = None) -> TransferResult:
        """``payload`` to the receiver's subject in ``params`` (a peer fetch sends staged bytes)."""
        t0 = time.perf_counter() if t0 is None else t0
        total = len(payload)
        if total != params.get("bytes", total):
            raise ValueError(f"the decode worker expects {params['bytes']} bytes, we have {total}")
        subject = params["subject"]
        chunk = max(1024, self.bus.max_payload - HEADROOM)
        sent_since_ack = 0
        index = 0
        for offset in range(0, total, chunk):
            piece = payload[offset : offset + chunk]
            msg = KvChunk(request_id, index, offset, total, piece)
            sent_since_ack += len(piece)
            index += 1
            if sent_since_ack >= WINDOW_BYTES or offset + chunk >= total:
                await self.bus.request_ack(subject, msg, timeout=10.0)
                sent_since_ack = 0
            else:
                await self.bus.publish(subject, msg, traced=False)
        return TransferResult(self.name, total, time.perf_counter() - t0, index)
