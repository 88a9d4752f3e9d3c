"""The embed pool's wire messages (``--task embed`` workers, issue 35).

They have the form of every message of the mesh (msgspec Structs: a msgpack map of their fields
plus ``"type"``, the class name; fields at their default left out), like the KV transports'
(``kvstore/transfer/messages.py``): ``mesh.protocol`` registers them with its one codec and
re-exports them, and ``docs/protocol.md`` documents them with the rest. Their own module keeps
``mesh/protocol.py`` on one screen's budget.
"""

from __future__ import annotations

import msgspec


class EmbedMessage(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True):
    """An embed pool message, sent on its own (the form of ``mesh.protocol.Message``)."""


class EmbedRequest(EmbedMessage):
    """Gateway -> embed worker, request on ``embed``: pool these prompts' hidden states. One HTTP
    request's inputs may come in several of these, each under the bus's ``max_payload``."""

    request_id: str
    model: str
    inputs: list[list[int]]
    dimensions: int = 0  # 0: the model's own size; else a matryoshka truncation (renormalised)
    priority: int = 0  # higher first in the worker's queue (as GenerateRequest.priority; batch lines below 0)


class EmbedReply(EmbedMessage):
    """The embed worker's answer: ``len(inputs)`` vectors of ``dim`` little-endian float32, row
    after row, L2-normalised; or ``error`` with an HTTP-like status (400: the inputs)."""

    request_id: str
    worker: str
    dim: int = 0
    vectors: bytes = b""
    error: str = ""
    error_status: int = 0


MESSAGES = (EmbedRequest, EmbedReply)
