"""One batch line as an in-process HTTP request to the gateway's own app.

The line's url and body become an ASGI ``http`` scope for the app behind the API-key guard, with
``scope["state"]["api_key"]`` set to the batch owner's key (as ``ApiKeys`` sets it), so every POST
route the gateway serves runs a batch line with no code of its own for batches: its parsing, its
limits, its tenancy. The line asks for the lowest priority (``x-priority``; the owner's key is
clamped to it too). The "client" never disconnects; cancelling the call cancels the request, and
the route cancels its work on the worker as it does for a client that leaves.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.auth import ApiKey
from gateway.batches.store import BATCH_PRIORITY
from gateway.errors import APIError

log = logging.getLogger(__name__)


async def call_route(app, url: str, body: bytes, key: ApiKey | None, timeout: float) -> tuple[int, bytes]:
    """POST ``body`` to ``url`` on ``app``: (status, response body). A timeout is a 504, an
    exception out of the app a 500 (logged), each with an OpenAI-shaped error body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("batch", 0),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"x-priority", str(BATCH_PRIORITY).encode())],
        "state": {"api_key": key},
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()

    async def receive():
        if pending:
            return pending.pop()
        await never.wait()  # the batch never leaves; a cancelled line is cancelled here
        return {"type": "http.disconnect"}

    status, chunks = [0], []

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await asyncio.wait_for(app(scope, receive, send), timeout)
    except TimeoutError:
        return 504, _error(504, f"the request took longer than {timeout:.0f} s")
    except Exception:
        log.exception("batch line on %s failed", url)
        if not status[0]:
            return 500, _error(500, "internal error")
    return status[0] or 500, b"".join(chunks)


def _error(status: int, message: str) -> bytes:
    return APIError(status, message).response().body
