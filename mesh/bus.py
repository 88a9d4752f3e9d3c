"""One NATS connection per process: subjects, the codec, timeouts, and no crashing handlers.

Every subscription handler gets a decoded message; bytes that do not decode
(over their type's size bound, nested too deeply, malformed) are logged, counted
(``pdmesh_bus_dropped_messages_total``) and dropped, and an exception in a handler is logged, never
allowed to kill the subscription. A ``Bus`` is the ``Messenger`` the KV
transports take (``kvstore.transfer.messenger``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.metrics import BUS_DROPPED
from mesh.natsauth import NatsConfig, check_jetstream, open_connection
from mesh.protocol import DecodeError, Subjects, decode, encode
from mesh.tracing import outgoing_headers

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[[Any, Msg], Awaitable[None]]


class Bus:
    def __init__(self, nc: Client, subjects: Subjects, reconnect_hooks: list | None = None):
        self.nc = nc
        self.subjects = subjects
        self._reconnect_hooks = reconnect_hooks if reconnect_hooks is not None else []
        self.js = nc.jetstream(timeout=5.0)
        self.dropped = 0  # undecodable messages received

    @classmethod
    async def connect(cls, url: str, name: str, ns: str = "mesh", timeout: float = 5.0,
                      config: NatsConfig | None = None, no_echo: bool = False) -> Bus:
        """Join NATS (``config``: servers, credentials, TLS; default: ``url`` with the credentials
        of the environment) and check that JetStream answers. ``NatsError`` names the cause and
        the fix when either fails. ``timeout``: seconds per connection attempt. ``no_echo``: the
        server does not deliver this connection's own messages back to it (a gateway publishes
        routing decisions on a subject it also listens on for other gateways')."""
        config = config or NatsConfig.build(url)
        conn: list[Client] = []
        hooks: list = []
        last_error = [0.0]
        where = config.display

        def closing() -> bool:  # or not connected yet: open_connection reports those errors itself
            return not conn or conn[0].is_closed or conn[0].is_draining

        async def on_error(e: Exception) -> None:
            # while the server is away every reconnect attempt fails: say so every 10 s, not every 0.5 s
            now = time.monotonic()
            if not closing() and now - last_error[0] >= 10.0:
                last_error[0] = now
                log.warning("nats: %s", e)

        async def on_disconnect() -> None:
            if not closing():
                log.warning("nats: disconnected from %s", where)

        async def on_reconnect() -> None:
            log.info("nats: reconnected to %s", where)
            for fn in list(hooks):
                try:
                    await fn()
                except Exception:
                    log.exception("reconnect hook failed")

        nc = await open_connection(
            config, name, error_cb=on_error, connect_timeout=timeout, reconnect_time_wait=0.5, ping_interval=5,
            max_outstanding_pings=3, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
            no_echo=no_echo,
        )
        try:
            await check_jetstream(nc, config)
        except BaseException:
            await nc.close()
            raise
        conn.append(nc)
        bus = cls(nc, Subjects(ns), hooks)
        bus.js_replicas = config.js_replicas  # of the streams and buckets this process creates
        return bus

    def on_reconnect(self, fn) -> None:
        """``await fn()`` after every reconnect (state the server may have lost: watches, streams)."""
        self._reconnect_hooks.append(fn)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def publish(self, subject: str, msg: Any, reply: str = "", headers: dict | None = None,
                      span=None, traced: bool = True) -> None:
        """``span``: carry this span's trace context (default: the current span's). ``traced=False``
        for high-rate messages nobody continues a trace from (token chunks, load reports, KV
        events): a header costs the sender an injection and every receiver a parse."""
        hdrs = outgoing_headers(headers, span) if traced else headers
        await self.nc.publish(subject, encode(msg), reply=reply, headers=hdrs)

    async def request(self, subject: str, msg: Any, expect: type[T], timeout: float) -> T:
        reply = await self.nc.request(subject, encode(msg), timeout=timeout, headers=outgoing_headers())
        return decode(reply.data, expect)

    async def request_ack(self, subject: str, msg: Any, timeout: float) -> None:
        """Send ``msg`` (untraced) and wait for the receiver's empty acknowledgement: the flow
        control of the nats KV transport's windows."""
        await self.nc.request(subject, encode(msg), timeout=timeout)

    async def respond(self, raw: Msg, msg: Any) -> None:
        """Reply ``msg`` to the received ``raw``."""
        await raw.respond(encode(msg))

    async def flush(self, timeout: float) -> None:
        """Wait until the server has everything sent so far (a subscription is in place after it)."""
        await self.nc.flush(timeout=timeout)

    async def subscribe(
        self, subject: str, handler: Handler, expect: type | None = None, queue: str = "",
        pending_msgs_limit: int = 65536,
    ) -> Subscription:
        kind = "message" if expect is None else expect.__name__

        async def on_msg(raw: Msg) -> None:
            try:
                msg = decode(raw.data, expect)  # refuses an oversized message before decoding it
            except DecodeError as e:
                self.dropped += 1
                BUS_DROPPED.labels(kind, e.reason).inc()
                log.warning("dropped a message on %s: %s", raw.subject, e)
                return
            try:
                await handler(msg, raw)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler for %s failed", raw.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=pending_msgs_limit)

    async def close(self, timeout: float = 5.0) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()
