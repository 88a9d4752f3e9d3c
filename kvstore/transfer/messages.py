"""The KV transports' own wire messages: the ``nats`` transport's ``KvChunk`` and the ``nccl``
transport's handshake.

They are defined here, below the mesh, so that a transport needs nothing of it. They have the
form of every message of the mesh (msgspec Structs: a msgpack map of their fields plus
``"type"``, the class name; fields at their default left out), and ``mesh.protocol`` registers
them with its one codec and re-exports them, so ``docs/protocol.md`` documents them with the
rest and the bus encodes and checks them like any other.
"""

from __future__ import annotations

import msgspec


class TransportMessage(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True):
    """A KV transport's message, sent on its own (the form of ``mesh.protocol.Message``)."""


class KvChunk(TransportMessage):
    """One piece of a request's KV over the nats transport (block-major bytes)."""

    request_id: str
    index: int
    offset: int
    total_bytes: int
    data: bytes


# -- the nccl transport's handshake (kvstore/transfer/nccl.py) --------------------


class NcclConnect(TransportMessage):
    """Prefill -> decode, request on ``nccl.connect``: join a two-rank communicator as rank 1."""

    session: str  # names the communicator on both sides
    sender: str  # the sending process: a new session from it replaces its older ones
    unique_id: bytes  # ncclUniqueId, 128 bytes


class NcclBegin(TransportMessage):
    """Prefill -> decode, request on ``nccl.begin``: post the recvs of this request's bytes."""

    session: str
    request_id: str
    nbytes: int
    chunk_bytes: int  # one send per this many bytes (the last one shorter)


class NcclReply(TransportMessage):
    ok: bool
    error: str = ""


MESSAGES = (KvChunk, NcclConnect, NcclBegin, NcclReply)
