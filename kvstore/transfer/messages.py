"""The KV transports' own wire messages: the ``nats`` transport's ``KvChunk`` and the ``nccl``
and ``nixl`` transports' handshakes.

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


# -- the nixl transport's handshake (kvstore/transfer/nixl_agent.py) ----------------


class NixlMetadataRequest(TransportMessage):
    """Sender -> receiver, request on ``nixl.md``: your NIXL agent's metadata, please."""

    agent: str  # the agent the asker expects (the params name it): another is refused


class NixlMetadata(TransportMessage):
    """The reply: the agent's metadata and the one region of each kind it registered (flat)."""

    agent: str
    rev: int  # how many regions it has registered: a sender holding an older rev asks again
    metadata: bytes  # nixl_agent.get_agent_metadata()
    kinds: list[str]  # "kv" (the KV pool), "fetch" (peer-fetch buffers), one per region
    addrs: list[int]
    sizes: list[int]
    mems: list[str]  # "DRAM" (CPU) or "VRAM" (GPU), one per region
    devices: list[int]  # the GPU of a VRAM region (0 for DRAM)


class NixlBegin(TransportMessage):
    """Sender -> receiver, request on ``nixl.begin``: may I write job ``job_id`` (a request id, or a
    fetch id)? Granted only for a job armed with ``gen`` and not revoked. With ``writing`` it is
    published instead, once the grant was given (ahead), as the write starts: the receiver polls
    its agent fast from then on."""

    kind: str  # "kv" | "fetch"
    job_id: str
    gen: int
    agent: str  # the writer's agent: its completion notification must come from it
    writing: bool = False  # published (no reply) by a writer granted earlier: its bytes start now


class NixlReply(TransportMessage):
    ok: bool
    error: str = ""


MESSAGES = (KvChunk, NcclConnect, NcclBegin, NcclReply, NixlMetadataRequest, NixlMetadata, NixlBegin, NixlReply)
