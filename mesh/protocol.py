"""The wire protocol of the mesh: every subject and every message, defined once.

Messages are dataclasses encoded with msgpack as a map of their fields plus a
``"type"`` key naming the class (nested messages are plain maps; the schema
says what they are). Decoding checks every field's type against its
annotation, so a malformed message is rejected at the edge with a
``DecodeError`` instead of failing deep inside a worker. Unknown fields are
ignored (newer senders may add fields); missing fields take their defaults.

``docs/protocol.md`` documents the same table for writers of custom workers.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, get_args, get_origin

import msgpack

T = TypeVar("T")

# -- subjects -------------------------------------------------------------------

_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(name: str) -> str:
    """A model or worker name as one NATS subject token (no dots, wildcards or spaces)."""
    token = _TOKEN_BAD.sub("_", name.strip())
    if not token:
        raise ValueError(f"{name!r} has no characters usable in a subject")
    return token


@dataclass(frozen=True)
class Subjects:
    """The subject table of one namespace. Model and worker names are sanitized here."""

    ns: str = "mesh"

    def _m(self, model: str) -> str:
        return f"{self.ns}.{subject_token(model)}"

    def generate(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.decode.{subject_token(worker)}.generate"

    def cancel(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.decode.{subject_token(worker)}.cancel"

    def kv_ready(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_ready"

    def kv_data(self, model: str, worker: str, request_id: str) -> str:
        """The nats transport's per-request data subject."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_data.{subject_token(request_id)}"

    def kv_data_all(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_data.*"

    def prefill_jobs(self, model: str) -> str:
        return f"{self._m(model)}.prefill.jobs"

    def prefill_stream(self, model: str) -> str:
        """The JetStream work-queue stream holding ``prefill_jobs``."""
        return f"{subject_token(self.ns)}_{subject_token(model)}_prefill"

    def kv_events(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.kv.events.{subject_token(worker)}"

    def kv_events_all(self, model: str) -> str:
        return f"{self._m(model)}.kv.events.*"

    def kv_events_any(self) -> str:
        """Every model's KV events (a router serves all models of a namespace)."""
        return f"{self.ns}.*.kv.events.*"

    def kv_snapshot(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.kv.snapshot.{subject_token(worker)}"

    def load(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.load.{subject_token(worker)}"

    def load_model(self, model: str) -> str:
        return f"{self._m(model)}.load.*"

    def load_all(self) -> str:
        return f"{self.ns}.*.load.*"

    def router_decisions(self) -> str:
        return f"{self.ns}.router.decisions"

    def planner_decisions(self) -> str:
        return f"{self.ns}.planner.decisions"

    def nccl(self, model: str, worker: str, verb: str) -> str:
        """The nccl transport's rendezvous and per-transfer handshake (verb: connect | begin)."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.nccl.{subject_token(verb)}"

    def control(self, worker: str) -> str:
        """Per-worker control (drain), used by the planner's local connector."""
        return f"{self.ns}.control.{subject_token(worker)}"

    def workers_bucket(self) -> str:
        return f"{subject_token(self.ns)}_workers"

    def kv_fetch(self, model: str, worker: str) -> str:
        """Peer fetch (issue 20): a worker asks the holder ``worker`` for prefix blocks."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_fetch"


# -- codec ----------------------------------------------------------------------


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type."""


MESSAGE_TYPES: dict[str, type] = {}
_CHECKERS: dict[type, list[tuple[str, Any]]] = {}


def message(cls: type[T]) -> type[T]:
    """Make ``cls`` a dataclass message registered under its class name."""
    cls = dataclass(cls)
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


def encode(msg: Any) -> bytes:
    body = _to_wire(msg)
    body["type"] = type(msg).__name__
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, expect: type[T] | None = None) -> T:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise DecodeError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise DecodeError("not a message (no type)")
    cls = MESSAGE_TYPES.get(obj["type"])
    if cls is None:
        raise DecodeError(f"unknown message type {obj['type']!r}")
    if expect is not None and cls is not expect:
        raise DecodeError(f"expected {expect.__name__}, got {cls.__name__}")
    return _from_wire(cls, obj)


def _to_wire(msg: Any) -> dict:
    out = {}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if type(v) in MESSAGE_TYPES.values():
            v = _to_wire(v)
        elif isinstance(v, list) and v and type(v[0]) in MESSAGE_TYPES.values():
            v = [_to_wire(x) for x in v]
        out[f.name] = v
    return out


def _from_wire(cls: type[T], obj: dict) -> T:
    kwargs = {}
    for name, check in _checkers(cls):
        if name in obj:
            try:
                kwargs[name] = check(obj[name])
            except (TypeError, ValueError) as e:
                raise DecodeError(f"{cls.__name__}.{name}: {e}") from None
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise DecodeError(f"{cls.__name__}: {e}") from None
    except ValueError as e:  # a message's own __post_init__ validation
        raise DecodeError(f"{cls.__name__}: {e}") from None


def _checkers(cls: type) -> list[tuple[str, Any]]:
    got = _CHECKERS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = [(f.name, _checker(hints[f.name])) for f in fields(cls)]
        _CHECKERS[cls] = got
    return got


def _checker(tp: Any):
    """A function that validates (and, for nested messages, builds) a value of type ``tp``."""
    origin = get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        opts = [a for a in get_args(tp) if a is not type(None)]
        inner = _checker(opts[0]) if len(opts) == 1 else (lambda v: v)
        return lambda v: None if v is None else inner(v)
    if origin is list:
        (arg,) = get_args(tp) or (Any,)
        if arg is int:
            return _int_list
        item = _checker(arg)
        return lambda v: [item(x) for x in _expect(v, list)]
    if origin is dict:
        args = get_args(tp)
        item = _checker(args[1]) if args else (lambda v: v)
        return lambda v: {_expect(k, str): item(x) for k, x in _expect(v, dict).items()}
    if tp in MESSAGE_TYPES.values():
        return lambda v: _from_wire(tp, _expect(v, dict))
    if tp is float:
        return lambda v: float(_expect(v, (int, float)))
    if tp is int:
        return _int
    if tp is bool:
        return lambda v: _expect(v, bool)
    if tp is str:
        return lambda v: _expect(v, str)
    if tp is bytes:
        return lambda v: _expect(v, bytes)
    if tp is dict:
        return lambda v: _expect(v, dict)
    return lambda v: v


def _expect(v: Any, tp: type | tuple[type, ...]) -> Any:
    # bool is an int subclass, but a bool where a number belongs is a malformed message
    if not isinstance(v, tp) or (isinstance(v, bool) and tp is not bool):
        raise TypeError(f"expected {_name(tp)}, got {type(v).__name__}")
    return v


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"expected int, got {type(v).__name__}")
    return v


def _int_list(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise TypeError("expected a list of ints")
    return v


def _as_tuple(tp):
    return tp if isinstance(tp, tuple) else (tp,)


def _name(tp) -> str:
    return "/".join(t.__name__ for t in _as_tuple(tp))


# -- messages -------------------------------------------------------------------


@message
class SamplingOptions:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@message
class GenerateRequest:
    """Gateway -> decode worker, on ``generate``; the reply subject receives ``TokenChunk``s."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    priority: int = 0  # higher first; interactive traffic 0, batch below (e.g. -1)
    created: float = 0.0  # unix seconds at the gateway
    # A migrated request: its last ``output_offset`` tokens were generated by another worker
    # (seeded sampling continues at that index; penalties count them as outputs).
    output_offset: int = 0


@message
class TokenLogprobs:
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@message
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@message
class TokenChunk:
    """Decode worker -> the request's reply subject: new tokens; the last one has finish_reason."""

    request_id: str
    index: int  # 0, 1, 2, ... per request, so a gap is detectable
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    usage: Usage | None = None
    error: str | None = None
    error_status: int = 0  # HTTP-like status for errors (400 bad request, 503 overloaded, ...)
    worker: str = ""


@message
class Cancel:
    request_id: str


@message
class PrefillJob:
    """Decode worker -> prefill pool (work queue): compute this prompt's KV into my blocks."""

    request_id: str
    model: str
    token_ids: list[int]
    decode_worker: str
    num_cached_tokens: int  # the decode worker already holds these (a whole number of blocks)
    dest_block_ids: list[int]  # decode blocks for the tokens after num_cached_tokens
    # transports the decode worker accepts, best first: name -> what the sender needs
    transports: dict[str, dict]
    deadline: float  # unix seconds; nothing may be written into the blocks after it
    block_size: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    created: float = 0.0  # unix seconds when the decode worker queued it
    output_offset: int = 0  # see GenerateRequest.output_offset
    priority: int = 0  # see GenerateRequest.priority


@message
class PrefillDone:
    """Prefill worker -> decode worker on ``kv_ready``: blocks written, first token sampled."""

    request_id: str
    prefill_worker: str
    ok: bool
    token_id: int = -1
    logprob: TokenLogprobs | None = None
    error: str | None = None
    transport: str = ""
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    compute_ms: float = 0.0
    num_chunks: int = 0  # nats transport: data messages sent before this one


@message
class KvChunk:
    """One piece of a request's KV over the nats transport (block-major bytes)."""

    request_id: str
    index: int
    offset: int
    total_bytes: int
    data: bytes


@message
class WorkerCard:
    """A worker's entry in the registry bucket, refreshed while it lives."""

    worker_id: str
    role: str  # decode | prefill
    model: str
    block_size: int
    kv_blocks: int
    max_model_len: int
    host: str
    pid: int
    started: float
    updated: float
    transports: dict[str, dict] = field(default_factory=dict)  # name -> what a peer needs to use it
    status: str = "ready"  # ready | draining
    capacity: int = 0  # concurrent sequences (decode) or prefill jobs (prefill)
    metrics_port: int = 0
    publishes_kv_events: bool = True
    engine: str = "model"  # model | mock
    # issue 20: per-block costs in ms (mesh.router.costs.KvCosts fields); {} = the reference hardware
    kv_costs: dict[str, float] = field(default_factory=dict)
    serves_kv_fetch: bool = False  # answers KvFetchRequest on kv_fetch.{worker}
    fetches_kv: bool = False  # fetches the blocks a router's decision names before prefilling


@message
class LoadReport:
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



@message
class KvEvent:
    """One change to a worker's cache. ``stored``: a chain of blocks, each the child of the one
    before, the first the child of ``parent``; ``removed``: blocks gone from ``tier``;
    ``cleared``: everything gone."""

    kind: str  # stored | removed | cleared
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    tier: str = "device"  # device | host | disk


@message
class KvEventBatch:
    """On ``kv.events.{worker}``, once per engine step with changes; ``seq`` counts batches, so a gap
    tells a router it missed some and must resync from a snapshot."""

    worker_id: str
    model: str
    seq: int
    events: list[KvEvent] = field(default_factory=list)


@message
class KvSnapshotRequest:
    page: int = 0
    snapshot_id: str = ""  # from page 0's reply; later pages come from the same snapshot


@message
class KvSnapshot:
    """Reply on ``kv.snapshot.{worker}``: every cached block by tier, as of batch ``seq``."""

    worker_id: str
    seq: int
    snapshot_id: str
    page: int
    pages: int
    blocks: dict[str, list[int]] = field(default_factory=dict)  # tier -> hashes on this page


@message
class RouterDecision:
    """On ``router.decisions``: so other gateway replicas count this request's load too."""

    router_id: str
    model: str
    worker_id: str
    request_id: str
    prompt_blocks: int
    new_blocks: int
    overlap_blocks: float
    mode: str
    timestamp: float
    # issue 20: the chosen worker's own leading run, and a peer to fetch the next blocks from
    hit_blocks: int = 0
    fetch_source: str = ""
    fetch_blocks: int = 0


@message
class PlannerDecision:
    """On ``planner.decisions``: one pool's size for the next window, and why."""

    pool: str  # prefill | decode
    model: str
    current: int
    target: int
    reason: str
    timestamp: float
    demand: float = 0.0
    capacity: float = 0.0
    latency_ms: float = 0.0
    connector: str = ""

# -- the nccl transport's handshake (kvstore/transfer/nccl.py) --------------------


@message
class NcclConnect:
    """Prefill -> decode, request on ``nccl.connect``: join a two-rank communicator as rank 1."""

    session: str  # names the communicator on both sides
    sender: str  # the sending process: a new session from it replaces its older ones
    unique_id: bytes  # ncclUniqueId, 128 bytes


@message
class NcclBegin:
    """Prefill -> decode, request on ``nccl.begin``: post the recvs of this request's bytes."""

    session: str
    request_id: str
    nbytes: int
    chunk_bytes: int  # one send per this many bytes (the last one shorter)


@message
class NcclReply:
    ok: bool
    error: str = ""


# -- peer fetch (issue 20, phase A: the mocker simulates it; phase B adds bytes) ----------


@message
class KvFetchRequest:
    """Requester -> holder, request on ``kv_fetch.{holder}``: send me the leading run of these
    blocks that you hold (any tier). The holder pins them until it has sent them or the deadline
    passes, and replies ``KvFetchDone`` when they are in place (phase A: when the simulated
    transfer is over; no bytes move yet)."""

    request_id: str
    model: str
    requester: str
    hashes: list[int]  # chained block hashes, consecutive, the first one's parent the requester holds
    deadline: float  # unix seconds: past it the holder sends nothing and unpins
    transports: dict[str, dict] = field(default_factory=dict)  # phase B: where to write, as PrefillJob
    dest_block_ids: list[int] = field(default_factory=list)  # phase B: the requester's blocks


@message
class KvFetchDone:
    """Holder -> requester, the reply: how many leading blocks of the request were sent."""

    request_id: str
    holder: str
    ok: bool
    num_blocks: int = 0
    tiers: dict[str, int] = field(default_factory=dict)  # of those, how many the holder read from each tier
    transfer_ms: float = 0.0  # holder side: pin to sent
    error: str = ""
