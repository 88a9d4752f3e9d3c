"""The wire protocol of the mesh: every message, defined once, and the one codec.

Messages are msgspec Structs encoded with msgpack as a map of their fields plus a
``"type"`` key naming the class (nested parts are plain maps; the schema says
what they are). Fields at their default are left out. Decoding checks every
field's type against its annotation (in msgspec's C code, no per-field Python),
so a malformed message is rejected at the edge with a ``DecodeError`` instead of
failing deep inside a worker. Unknown fields are ignored (newer senders may add
fields); missing fields take their defaults.

Bounds (a peer's bytes cost the receiver no more than their size allows): every message
type has a size limit (``MAX_BYTES``; each subject carries one type), checked before a
byte is decoded; no field is an untyped ``dict`` or ``Any``, so nesting is bounded by the
schema (a transport's parameters, ``Params``, are scalars, flat lists and maps one level
deep), and input nested past the decoder's recursion limit is a ``DecodeError`` too.

The subject table is ``mesh/subjects.py``; the KV transports' own messages (``KvChunk``,
``NcclConnect``, ``NcclBegin``, ``NcclReply``, the ``Nixl*`` handshake) are defined below the mesh, in
``kvstore/transfer/messages.py``, the embed pool's in ``mesh/embed_messages.py``, the token link's, the LoRA admin's
and the load reports in ``mesh/side_messages.py``. All are re-exported here, and the transports' messages
go through this codec like every other.

``docs/protocol.md`` documents the same table for writers of custom workers.
"""

from __future__ import annotations

import typing
from typing import Annotated, TypeVar

import msgspec
from msgspec import field

from kvstore.transfer.messages import MESSAGES as TRANSPORT_MESSAGES
from kvstore.transfer.messages import KvChunk as KvChunk
from kvstore.transfer.messages import NcclBegin as NcclBegin
from kvstore.transfer.messages import NcclConnect as NcclConnect
from kvstore.transfer.messages import NcclReply as NcclReply
from kvstore.transfer.messages import NixlBegin as NixlBegin
from kvstore.transfer.messages import NixlMetadata as NixlMetadata
from kvstore.transfer.messages import NixlMetadataRequest as NixlMetadataRequest
from kvstore.transfer.messages import NixlReply as NixlReply
from kvstore.transfer.messages import TransportMessage
from mesh.embed_messages import MESSAGES as EMBED_MESSAGES
from mesh.embed_messages import EmbedReply as EmbedReply
from mesh.embed_messages import EmbedRequest as EmbedRequest
from mesh.params import Transports, checked_transports
from mesh.side_messages import MESSAGES as SIDE_MESSAGES
from mesh.side_messages import HostCards as HostCards
from mesh.side_messages import LinkHello as LinkHello
from mesh.side_messages import LinkReady as LinkReady
from mesh.side_messages import LoadReport as LoadReport
from mesh.side_messages import LoadReports as LoadReports
from mesh.side_messages import LoraReply as LoraReply
from mesh.side_messages import LoraRequest as LoraRequest
from mesh.side_messages import RankInvite as RankInvite
from mesh.side_messages import RankJoin as RankJoin
from mesh.subjects import Subjects as Subjects
from mesh.subjects import max_bytes
from mesh.subjects import subject_token as subject_token
from mesh.worker_layout import WorkerLayout as WorkerLayout

T = TypeVar("T")
V = TypeVar("V")
Tiered = Annotated[dict[str, V], msgspec.Meta(max_length=8)]  # by KV tier: a handful of keys, checked before decoding

# -- codec ----------------------------------------------------------------------


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type. ``reason`` for the counters:
    oversized (over the type's ``MAX_BYTES``, never decoded) | too_deep | undecodable."""

    def __init__(self, message: str, reason: str = "undecodable"):
        super().__init__(message)
        self.reason = reason


# Every message and part by class name (docs/protocol.md documents each); only the tagged ones
# (``Message``s and the transports' messages) arrive on their own.
MESSAGE_TYPES: dict[str, type] = {}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type | None, tuple[msgspec.msgpack.Decoder, int]] = {}  # with the size limit


def register(cls: type) -> type:
    """Add a message class to the codec's table (a ``Message`` does when it is defined)."""
    MESSAGE_TYPES[cls.__name__] = cls
    _DECODERS.pop(None, None)  # the any-message decoder is rebuilt with the new member
    return cls


class Message(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True):
    """A message sent on its own: a msgpack map of its fields plus ``"type"``, the class name.
    Fields left at their default are omitted (a receiver fills them in)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register(cls)


class Part(msgspec.Struct, omit_defaults=True):
    """A message only ever nested in another (a plain map: its place in the schema says what it is)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        MESSAGE_TYPES[cls.__name__] = cls


for _message in (*TRANSPORT_MESSAGES, *EMBED_MESSAGES, *SIDE_MESSAGES):  # a Message's form, defined in their own modules
    register(_message)
MESSAGE_TYPES[WorkerLayout.__name__] = WorkerLayout  # a Part's form, defined in its own module


def encode(msg: Message | TransportMessage) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes, expect: type[T] | None = None) -> T:
    """The message in ``data``; ``expect`` a message class to accept only that one."""
    entry = _DECODERS.get(expect)
    if entry is None:
        if expect is None:
            tagged = tuple(c for c in MESSAGE_TYPES.values() if c.__struct_config__.tag is not None)
            entry = msgspec.msgpack.Decoder(typing.Union[tagged]), max_bytes(None)  # noqa: UP007
        else:
            # the wire type's bound: a reader's narrower struct (the router's LoadSummary) has its tag
            entry = msgspec.msgpack.Decoder(expect), max_bytes(expect.__struct_config__.tag or expect.__name__)
        _DECODERS[expect] = entry
    dec, limit = entry
    if len(data) > limit:  # before decoding a byte: the size is all a peer controls
        raise DecodeError(f"{len(data)} bytes, over the {limit} of a {getattr(expect, '__name__', 'message')}",
                          "oversized")
    try:
        return dec.decode(data)
    except msgspec.ValidationError as e:  # wrong type tag, field type, or a __post_init__ check
        raise DecodeError(str(e)) from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"not msgpack: {e}") from None
    except RecursionError:  # msgspec's guard against nesting deeper than the C stack allows
        raise DecodeError("nested too deeply", "too_deep") from None


# -- messages -------------------------------------------------------------------

class SamplingOptions(Part):
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
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    # The output must match this grammar (issue 17; the block at the end of this module). nil: free.
    constraint: ConstraintSpec | None = None
    speculate: bool = True  # false: the request opts out of speculative decoding (the worker's own, if any)


class GenerateRequest(Message):
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
    # Where the worker may send this request's chunks batched with other requests' (``TokenBatch``),
    # each chunk tagged with ``stream``; empty: one ``TokenChunk`` message per chunk to the reply subject.
    batch_to: str = ""
    stream: str = ""
    # The gateway's token link (mesh.tokenlink), for batch_to's batches: its host:port and this
    # worker's key on it. Empty: the bus only.
    batch_link: str = ""
    batch_link_key: str = ""
    # The LoRA adapter the request runs (a name the worker's card lists in ``adapters``); "": the base model
    adapter: str = ""
    # The router's plan (issue 20): fetch ``fetch_blocks`` blocks after the first ``hit_blocks``
    # of the prompt from the peer ``fetch_source`` before prefilling (None: no fetch planned).
    peer_fetch: PeerFetchPlan | None = None
    # The request's cache scope (issue 32): an opaque id of its tenant (or cache group) and
    # cache_salt, part of its block-hash seed, so prefixes are shared only within one scope. "": none.
    cache_scope: str = ""


class PeerFetchPlan(Part):
    """In ``GenerateRequest``: the router's fetch-vs-prefill decision for the chosen worker."""

    fetch_source: str  # the worker holding the blocks
    fetch_blocks: int  # how many
    hit_blocks: int = 0  # the chosen worker's own leading run, as the router saw it


class TokenLogprobs(Part):
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class Usage(Part):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenChunk(Message):
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
    stream: str = ""  # in a TokenBatch: the request's GenerateRequest.stream


class TokenBatch(Message):
    """Decode worker -> a ``GenerateRequest.batch_to`` subject, once per engine step: every chunk the
    step produced for the requests that named that subject, in step order."""

    worker: str
    chunks: list[TokenChunk] = field(default_factory=list)


class Cancel(Message):
    """Gateway -> decode worker: stop this request. ``reply`` is the request's reply subject, which
    only the gateway that sent it (and the worker serving it) knows: a Cancel naming another is
    refused (logged, counted, dropped), so one gateway cannot cancel another's request."""

    request_id: str
    reply: str = ""


class PrefillJob(Message):
    """Decode worker -> prefill pool (work queue): compute this prompt's KV into my blocks."""

    request_id: str
    model: str
    token_ids: list[int]
    decode_worker: str
    num_cached_tokens: int  # the decode worker already holds these (a whole number of blocks)
    dest_block_ids: list[int]  # decode blocks for the tokens after num_cached_tokens
    # transports the decode worker accepts, best first: name -> what the sender needs
    transports: Transports
    deadline: float  # unix seconds; nothing may be written into the blocks after it
    block_size: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    created: float = 0.0  # unix seconds when the decode worker queued it
    output_offset: int = 0  # see GenerateRequest.output_offset
    priority: int = 0  # see GenerateRequest.priority
    adapter: str = ""  # see GenerateRequest.adapter: a prefill worker without it leaves the job to others
    cache_scope: str = ""  # see GenerateRequest.cache_scope
    # A random capability for this job: its PrefillDone must echo it (only the prefill worker that
    # pulled the job knows it), or the decode worker refuses the PrefillDone.
    token: str = ""

    def __post_init__(self):
        checked_transports(self.transports)


class PrefillDone(Message):
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
    token: str = ""  # the job's PrefillJob.token


class WorkerCard(Message):
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
    transports: Transports = field(default_factory=dict)  # name -> what a peer needs to use it
    status: str = "ready"  # ready | draining
    capacity: int = 0  # concurrent sequences (decode) or prefill jobs (prefill)
    metrics_port: int = 0
    publishes_kv_events: bool = True
    engine: str = "model"  # model | mock
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded here (requests may name them)
    max_loras: int = 0  # LoRA adapters one engine step can run (device slots); 0: LoRA off
    # issue 20: per-block costs in ms (mesh.router.costs.KvCosts fields); {} = the reference hardware
    kv_costs: dict[str, float] = field(default_factory=dict)
    kv_block_bytes: int = 0  # one KV block's bytes, all layers and planes (what the router costs a move by); 0: unknown
    serves_kv_fetch: bool = False  # answers KvFetchRequest on kv_fetch.{worker}
    fetches_kv: bool = False  # fetches the blocks a router's decision names before prefilling
    embed_dim: int = 0  # role "embed" (``--task embed``): the size of its vectors
    layout: WorkerLayout = field(default_factory=WorkerLayout)  # its ranks (TP x PP); default: one
    kv_dtype: str = ""  # its KV pool's dtype (float8_e4m3fn with --kv-cache-dtype fp8); "": no KV bytes (mock)

    def __post_init__(self):
        checked_transports(self.transports)


class KvEvent(Part):
    """One change to a worker's cache. ``stored``: a chain of blocks, each the child of the one
    before, the first the child of ``parent``; ``removed``: blocks gone from ``tier``;
    ``cleared``: everything gone."""

    kind: str  # stored | removed | cleared
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    tier: str = "device"  # device | host | disk


class KvEventBatch(Message):
    """On ``kv.events.{worker}``, once per engine step with changes; ``seq`` counts batches, so a gap
    tells a router it missed some and must resync from a snapshot."""

    worker_id: str
    model: str
    seq: int
    events: list[KvEvent] = field(default_factory=list)


class KvEventBatches(Message):
    """On ``kv.batches.{process}``: the batches the decode workers of one process numbered in one turn
    of its loop (``mesh.kvevents.KvBatcher``), each read as if it came alone on its worker's subject."""

    batches: list[KvEventBatch] = field(default_factory=list)


class KvSnapshotRequest(Message):
    page: int = 0
    snapshot_id: str = ""  # from page 0's reply; later pages come from the same snapshot


class KvSnapshot(Message):
    """Reply on ``kv.snapshot.{worker}``: every cached block by tier, as of batch ``seq``."""

    worker_id: str
    seq: int
    snapshot_id: str
    page: int
    pages: int
    blocks: Tiered[list[int]] = field(default_factory=dict)  # tier -> hashes on this page


class RouterDecision(Message):
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


class PlannerDecision(Message):
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

class KvFetchRequest(Message):
    """Requester -> holder, request on ``kv_fetch.{holder}``: send me the leading run of these
    blocks that you hold (any tier). The holder pins them until it has sent them or the deadline
    passes, writes their bytes through the first of ``transports`` it can use, and replies
    ``KvFetchDone`` once they are all written (the mocker sends no bytes: it waits out the
    transfer time its timing model gives)."""

    request_id: str
    model: str
    requester: str
    hashes: list[int]  # chained block hashes, consecutive, the first one's parent the requester holds
    deadline: float  # unix seconds: past it the holder sends nothing more and unpins
    # transports the requester accepts, best first: name -> where to write (a buffer of this fetch's
    # own: shm {"path", "host", "bytes"}, nats {"subject", "bytes"}); "bytes" is for every hash
    transports: Transports = field(default_factory=dict)
    fetch_id: str = ""  # names this fetch's buffers (several fetches may serve one request)
    block_bytes: int = 0  # the requester's bytes per block: a holder with another layout refuses

    def __post_init__(self):
        checked_transports(self.transports)


class KvFetchDone(Message):
    """Holder -> requester, the reply: how many leading blocks of the request were written."""

    request_id: str
    holder: str
    ok: bool
    num_blocks: int = 0
    tiers: Tiered[int] = field(default_factory=dict)  # of those, how many the holder read from each tier
    transfer_ms: float = 0.0  # holder side: pin to sent
    error: str = ""
    transport: str = ""  # the one the bytes took ("" : none moved)
    transfer_bytes: int = 0
    # shm, a holder whose blocks live in shared memory: nothing was written, the run is *lent*:
    # {"kv", "slots": file names, "spec": the holder's KV spec, "where": per block 0 (its KV
    # file) / 1 (its host-tier slots) / 2 (written into the requester's buffer at that row),
    # "index": block id / slot / row, "until": unix seconds the pins hold}. The requester reads
    # the blocks itself (only from the files the holder's card names), then sends
    # ``KvFetchRelease``; until then (or "until") they stay pinned.
    lent: LentRun | None = None
    # A lent run: the secret its ``KvFetchRelease`` must carry (random per fetch; only the requester
    # sees this reply), so nobody else who learns the fetch id can unpin the run while it is read.
    release_key: str = ""


class LentRun(Part):
    """In ``KvFetchDone``: where a lent run's blocks are in the holder's shared files."""

    kv: str  # the holder's KV file, a name in the mesh's shm directory (its card names it)
    slots: str  # its host-tier slots file (likewise)
    spec: dict[str, int | str]  # its KV spec (kvstore.cache.KVCacheSpec.to_dict)
    where: list[int]  # per block: 0 the KV file, 1 the slots file, 2 the requester's buffer
    index: list[int]  # per block: a block id, a slot, or its row in the requester's buffer
    until: float  # unix seconds: the pins' lease

    def to_dict(self) -> dict:
        """As the shm fetch channel reads it (``kvstore.transfer.fetch.ShmChannel.take``)."""
        return msgspec.structs.asdict(self)


class KvFetchRelease(Message):
    """Requester -> holder, on ``kv_fetch_release.{holder}``: the lent run of this fetch is read;
    unpin it (the pins' lease ends it anyway). Without the fetch's ``release_key`` (from its
    ``KvFetchDone``) it changes nothing."""

    requester: str
    fetch_id: str
    release_key: str = ""


class ConstraintSpec(Part):
    """What a request's output must match, as source text: never a token mask. The worker that
    samples compiles it against its own tokenizer (cached) and, for a request that arrives with
    tokens already generated (``output_offset``, a prefill worker's first token), rebuilds the
    matcher from them. A worker that cannot enforce it answers 400; it never ignores it."""

    kind: str  # json_schema | json_object | regex | lark (mesh.constraints.spec.ConstraintKind)
    source: str = ""  # the JSON schema (JSON text), the regex, or the Lark grammar; "" for json_object
    start_after: int | None = None  # a token id: the output is free until it is generated, constrained after
