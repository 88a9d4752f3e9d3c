"""Messages off the request path: a worker's load reports (``mesh.loads``), a process's cards
(``mesh.cardset``), a token link's handshake
(``mesh.tokenlink``), the LoRA admin's, and a worker's ranks on other hosts joining it
(``engine.parallel.rendezvous``).

They have the form of every message of the mesh (msgspec Structs: a msgpack map of their fields
plus ``"type"``, the class name; fields at their default left out), like the embed pool's
(``mesh/embed_messages.py``): ``mesh.protocol`` registers them with its one codec and re-exports
them, and ``docs/protocol.md`` documents them with the rest. Their own module keeps
``mesh/protocol.py`` on one screen's budget.
"""

from __future__ import annotations

import msgspec
from msgspec import field


class SideMessage(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True):
    """A message sent on its own (the form of ``mesh.protocol.Message``)."""


class LoadReport(SideMessage):
    """Periodic, on ``load``: what the router and planner need to know about a worker."""

    worker_id: str
    model: str
    role: str
    timestamp: float
    waiting: int = 0
    running: int = 0
    waiting_for_kv: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    pending_prefill_tokens: int = 0
    capacity: int = 0
    active_jobs: int = 0  # prefill: jobs being computed or sent
    ttft_ms: float = 0.0  # mean over the last ~20 s (prefill workers: job compute time)
    itl_ms: float = 0.0  # mean over the last ~20 s
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    requests_total: int = 0
    status: str = "ready"
    counters: dict[str, int] = field(default_factory=dict)  # e.g. remote_prefill_done, transport_shm
    hot_adapters: list[str] = field(default_factory=list)  # LoRA adapters in device slots now (no swap-in)
    deferrable: int = 0  # of running + waiting + waiting_for_kv: below priority 0 (batch work; the planner defers it)


class LoadReports(SideMessage):
    """Periodic, on ``loads``: the ``LoadReport``s of the decode workers of one process that ticked
    together (``mesh.loads``), one message for all of them."""

    reports: list[LoadReport] = field(default_factory=list)


class HostCards(SideMessage):
    """The registry value under a process's set key (``{role}.set.{process}-{n}``, ``mesh.cardset``):
    the cards of up to ``MAX_CARDS`` of its workers, refreshed together. ``updated`` (time.time())
    is every card's (their own ``updated`` is 0 in it, so a refresh changes only these 8 bytes);
    each card is an encoded ``WorkerCard``, read under that type's own bound."""

    updated: float
    cards: list[bytes] = field(default_factory=list)


class LinkHello(SideMessage):
    """Decode worker -> gateway, first on a token link (``mesh.tokenlink``): who it is, and the key
    its requests carried (``GenerateRequest.batch_link_key``)."""

    worker: str
    key: str


class LinkReady(SideMessage):
    """Gateway -> decode worker on a token link: the hello was good; TokenBatches may follow."""


class LoraRequest(SideMessage):
    """Admin -> every worker of a model, request on ``lora``: load a PEFT adapter directory (each
    worker reads it from its own file system) under ``name``, or unload ``name``."""

    action: str  # load | unload
    name: str
    path: str = ""  # load: the adapter directory


class LoraReply(SideMessage):
    """A worker's answer to a ``LoraRequest``; ``adapters``: what it holds afterwards."""

    worker_id: str
    ok: bool
    error: str = ""
    status: int = 0  # on failure: 400 (a broken adapter, a bad name), 404 (unload of an unknown name)
    adapters: list[str] = field(default_factory=list)


class RankJoin(SideMessage):
    """``mesh rank --join`` -> the worker, request on ``rank_join``: take rank ``rank`` of its layout
    (-1: any it still waits for). ``proof``: HMAC-SHA256 under the worker's group token of the
    other fields (``engine.parallel.rendezvous.join_proof``); the token itself never travels."""

    worker: str
    nonce: str  # fresh per join, hex
    proof: str  # hex
    rank: int = -1
    host: str = ""  # the joiner's hostname, for logs


class RankInvite(SideMessage):
    """The worker's answer to a ``RankJoin``: refused (``error``), or the rank held for the joiner
    and where its lifeline connects (a TCP address and port), with the worker's layout.
    ``proof``: HMAC-SHA256 under the group token (``invite_proof``): the joiner connects only to
    the worker that holds it."""

    ok: bool
    error: str = ""
    rank: int = -1
    address: str = ""
    port: int = 0
    tp: int = 1
    pp: int = 1
    proof: str = ""


MESSAGES = (LoadReport, LoadReports, HostCards, LinkHello, LinkReady, LoraRequest, LoraReply, RankJoin, RankInvite)
