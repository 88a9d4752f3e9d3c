"""A minimal streaming HTTP/1.1 client for the load generators (gateway, capacity, planner).

httpx spends more CPU per SSE event than the gateway does, and the load generator
shares the machine's cores with what it measures; this is a few lines of byte
scanning per read instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and yields SSE ``data:`` payloads."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    async def post_sse(self, path: str, body: bytes):
        """Yields (monotonic time, payload bytes) per SSE event. A status other than 200 raises
        ``RuntimeError`` with the status line and the start of the body."""
        if self.writer is None:
            await self.open()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        r = self.reader
        status = await r.readline()
        chunked, length = False, 0
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
            elif k == b"content-length":
                length = int(v)
        if b" 200 " not in status:
            data = await r.readexactly(length) if not chunked else b""
            raise RuntimeError(f"{status.strip().decode(errors='replace')} {data[:200]!r}")
        if not chunked:  # one body: split into events
            data = await r.readexactly(length)
            now = time.monotonic()
            for ev in data.split(b"\n\n"):
                if ev.startswith(b"data: "):
                    yield now, ev[6:]
            return
        buf = b""
        while (size := int((await r.readline()).strip(), 16)) > 0:
            buf += await r.readexactly(size)
            await r.readexactly(2)
            now = time.monotonic()
            while (end := buf.find(b"\n\n")) >= 0:
                ev, buf = buf[:end], buf[end + 2:]
                if ev.startswith(b"data: "):
                    yield now, ev[6:]
        await r.readline()
