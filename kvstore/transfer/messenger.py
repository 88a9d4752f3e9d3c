"""What a KV transport needs of the bus: the ``Messenger`` interface, defined here so that the
transports import nothing above kvstore. ``mesh.bus.Bus`` satisfies it as it is (structurally);
a transport gets it as its ``bus`` argument.

Contract:
- Subjects come from ``subjects``, the mesh's one subject table (``mesh.protocol.Subjects``): a
  transport never builds a subject string itself.
- Messages are ``kvstore.transfer.messages`` classes; the messenger encodes and decodes them
  with the mesh's codec. A handler gets the decoded message and the delivery (its reply subject,
  ``respond`` for raw bytes); bytes that do not decode never reach it.
- Nothing a transport sends carries trace headers (``publish`` with ``traced=False``,
  ``request_ack``): they are bulk or handshake messages nobody continues a trace from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class TransferSubjects(Protocol):
    """The subjects of the mesh's table that the transports use."""

    def kv_data(self, model: str, worker: str, request_id: str) -> str: ...

    def kv_data_all(self, model: str, worker: str) -> str: ...

    def kv_fetch_data(self, model: str, worker: str, fetch_id: str) -> str: ...

    def nccl(self, model: str, worker: str, verb: str) -> str: ...

    def nixl(self, model: str, worker: str, verb: str) -> str: ...


class Delivery(Protocol):
    """A received message's envelope (a ``nats.aio.msg.Msg``)."""

    reply: str

    async def respond(self, data: bytes) -> None: ...


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


Handler = Callable[[Any, Delivery], Awaitable[None]]


class Messenger(Protocol):
    @property
    def subjects(self) -> TransferSubjects: ...

    @property
    def max_payload(self) -> int:
        """The largest message the server takes, in bytes."""
        ...

    async def publish(self, subject: str, msg: Any, *, traced: bool = ...) -> None: ...

    async def request(self, subject: str, msg: Any, expect: type[T], timeout: float) -> T:
        """Send ``msg`` and wait for a reply of type ``expect``."""
        ...

    async def request_ack(self, subject: str, msg: Any, timeout: float) -> None:
        """Send ``msg`` and wait for the receiver's empty acknowledgement (flow control)."""
        ...

    async def respond(self, raw: Delivery, msg: Any) -> None:
        """Reply ``msg`` to the delivery ``raw``."""
        ...

    async def subscribe(self, subject: str, handler: Handler, expect: type | None = ..., *,
                        pending_msgs_limit: int = ...) -> Subscription: ...

    async def flush(self, timeout: float) -> None:
        """Wait until the server has everything sent so far (subscriptions included)."""
        ...
