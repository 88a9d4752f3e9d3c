"""Least-privilege NATS permissions per role, from the subject table (``docs/protocol.md``).

One NATS user per role; each may publish and subscribe only what its role does:

    role      publishes                                   subscribes
    gateway   generate, cancel, embed, kv.snapshot        kv.events, kv.batches, load, loads,
              (request), router.decisions, lora           router.decisions, planner.decisions,
              (request), stored responses, files and      its inbox
              batches (its buckets)
    decode    kv.events, kv.batches, load, loads,         generate, cancel, embed, kv_ready, kv_data,
              prefill jobs, replies to gateway, prefill   nccl, nixl, kv_fetch, kv_fetch_data,
              and decode inboxes, kv_fetch, kv_fetch_data, kv_fetch_release, kv.snapshot, load, lora,
              kv_fetch_release and nixl (peer fetch),     ranks.*.join, its inbox
              its card, ranks.*.join (mesh rank runs
              as the decode user)
    prefill   kv_ready, kv_data, nccl and nixl            lora, its inbox (jobs come by a JetStream
              (requests), load, lora replies (only to a   pull)
              gateway's LoRA inboxes), its registry card
    planner   planner.decisions                           load, loads, planner.decisions, its inbox

Every role also subscribes to the registry bucket's subjects (``$KV.{ns}_workers.>``: the cards
its view follows after the watch's replay, ``mesh.registry``), plus the JetStream API calls each
role makes on the registry bucket
(``KV_{ns}_workers``) and the prefill streams (``{ns}_{model}_prefill``): info,
create, the registry watch, the prefill pull consumer and its acks. Nobody may
delete, purge or update a stream. Inboxes are per role (``_INBOX.{role}``, which
``NatsConfig.inbox_prefix`` sets), so a worker cannot read a gateway's replies.

Subjects take any model of the namespace (routers and planners listen to all of
them). With the served models known (the Helm chart knows its one model), stream
names are exact; without, a ``*`` stands for the stream, which lets the workers
create other streams of the account (bounded by its JetStream limits).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mesh.protocol import Subjects

ROLES = ("gateway", "decode", "prefill", "planner")
ANY = "*"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def to_dict(self) -> dict:
        """As in a nats-server user: ``{"publish": {"allow": [...]}, "subscribe": {"allow": [...]}}``."""
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}

    def to_jwt(self) -> dict:
        """As in the ``nats`` claims of a user JWT (operator mode; what ``nsc add user
        --allow-pub ... --allow-sub ...`` writes): ``{"pub": {"allow"}, "sub": {"allow"}}``."""
        return {"pub": {"allow": list(self.publish)}, "sub": {"allow": list(self.subscribe)}}


def inbox(role: str) -> str:
    return f"_INBOX.{role}.>"


LORA_REPLIES = "lora"  # a gateway's LoRA broadcasts take replies on _INBOX.gateway.lora.*


def lora_reply_inbox(new_inbox: str) -> str:
    """A gateway's inbox (``nc.new_inbox()``) moved under ``LORA_REPLIES``: prefill workers may
    publish there (their LoRA replies) and nowhere else among the gateway's inboxes, whose other
    subjects carry token streams (only decode workers may write those)."""
    prefix, _, unique = new_inbox.rpartition(".")
    return f"{prefix}.{LORA_REPLIES}.{unique}"


def _registry(ns: str, writes: bool) -> list[str]:
    """The registry bucket: open or create it, watch it (an ordered consumer), read a card;
    workers also put and delete their own card."""
    bucket = Subjects(ns).workers_bucket()
    stream = f"KV_{bucket}"
    api = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}",
           f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
           f"$JS.API.CONSUMER.DELETE.{stream}.*", f"$JS.API.CONSUMER.INFO.{stream}.*",
           f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>"]
    return ["$JS.API.INFO", *api, *([f"$KV.{bucket}.>"] if writes else [])]


def _registry_follow(ns: str) -> str:
    """What a registry view subscribes to after its first replay (``mesh.registry.Membership``): the
    bucket's puts and deletes as they are published."""
    return f"$KV.{Subjects(ns).workers_bucket()}.>"


def _responses(ns: str) -> list[str]:
    """The stored responses' bucket (the gateway's): open or create it, get, put and purge keys."""
    bucket = Subjects(ns).responses_bucket()
    stream = f"KV_{bucket}"
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$KV.{bucket}.>"]


def _batches(ns: str) -> list[str]:
    """The Batch API's stores (the gateway's): the files' object store and the batches' bucket:
    open or create them, put, get, list (an ordered consumer), watch, purge."""
    s = Subjects(ns)
    kv, obj = s.batches_bucket(), s.files_bucket()
    api = []
    for stream in (f"KV_{kv}", f"OBJ_{obj}"):
        api += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.PURGE.{stream}",
                f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
                f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.DELETE.{stream}.*", f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>"]
    return [*api, "$JS.API.STREAM.NAMES", f"$KV.{kv}.>", f"$O.{obj}.>"]  # names: the object store finds its stream


def _prefill_streams(ns: str, models: Sequence[str]) -> list[str]:
    """Stream names as a subject token: exact per model, or any (a stream name is one token)."""
    return [Subjects(ns).prefill_stream(m) for m in models] if models else [ANY]


def permissions(role: str, ns: str = "mesh", models: Sequence[str] = ()) -> Permissions:
    """What ``role`` may publish and subscribe in namespace ``ns``. Subjects take any model (the
    routers and the planner listen to every model of a namespace); ``models``, when known, make
    the prefill streams' names exact."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    s = Subjects(ns)
    m = f"{ns}.{ANY}"
    streams = _prefill_streams(ns, models)
    decode = f"{m}.decode.{ANY}"
    load = s.load_all()
    loads = s.loads_all()  # a process's decode workers' reports together (mesh.loads)
    lora = f"{m}.lora"  # runtime adapter load/unload: the gateway asks, every worker answers
    rank_join = f"{ns}.ranks.{ANY}.join"  # a worker's ranks on other hosts join it (mesh rank: the decode user's credentials)
    if role == "gateway":
        # stored responses (the Responses API), files and batches (the Batch API): the gateway's buckets
        pub = [f"{decode}.generate", f"{decode}.cancel", f"{decode}.embed", f"{m}.kv.snapshot.{ANY}",
               s.router_decisions(), lora, *_registry(ns, False), *_responses(ns), *_batches(ns)]
        sub = [s.kv_events_any(), s.kv_batches_any(), load, loads, s.router_decisions(), s.planner_decisions(),
               inbox("gateway"), _registry_follow(ns)]
    elif role == "decode":
        # peer fetch: a decode worker asks another for blocks (and answers its requests, bytes over nats)
        pub = [f"{m}.kv.events.{ANY}", f"{m}.kv.batches.{ANY}", load, loads, f"{m}.prefill.jobs", inbox("gateway"),
               inbox("prefill"), inbox("decode"), f"{decode}.kv_fetch", f"{decode}.kv_fetch_data.{ANY}", f"{decode}.kv_fetch_release",
               f"{decode}.nixl.{ANY}", rank_join,
               *_registry(ns, True), *(f"$JS.API.STREAM.{verb}.{st}" for st in streams for verb in ("INFO", "CREATE"))]
        sub = [*(f"{decode}.{v}" for v in ("generate", "cancel", "embed", "kv_ready", f"kv_data.{ANY}", f"nccl.{ANY}",
                                            f"nixl.{ANY}", "kv_fetch", f"kv_fetch_data.{ANY}", "kv_fetch_release")),
               f"{m}.kv.snapshot.{ANY}", load, lora, rank_join, inbox("decode"), _registry_follow(ns)]
    elif role == "prefill":
        pub = [f"{decode}.kv_ready", f"{decode}.kv_data.{ANY}", f"{decode}.nccl.{ANY}", f"{decode}.nixl.{ANY}", load,
               f"_INBOX.gateway.{LORA_REPLIES}.>", *_registry(ns, True)]
        for st in streams:
            pub += [f"$JS.API.STREAM.INFO.{st}", f"$JS.API.STREAM.CREATE.{st}", f"$JS.API.CONSUMER.INFO.{st}.*",
                    f"$JS.API.CONSUMER.CREATE.{st}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.*",
                    f"$JS.API.CONSUMER.MSG.NEXT.{st}.*", f"$JS.ACK.{st}.>"]
        sub = [lora, inbox("prefill"), _registry_follow(ns)]
    else:  # planner (and mesh top: it reads what the planner reads)
        pub = [s.planner_decisions(), *_registry(ns, False)]
        sub = [load, loads, s.planner_decisions(), inbox("planner"), _registry_follow(ns)]
    return Permissions(tuple(dict.fromkeys(pub)), tuple(dict.fromkeys(sub)))


def authorization_block(users: Mapping[str, Mapping[str, str]], ns: str = "mesh",
                        models: Sequence[str] = (), extra: Sequence[Mapping] = ()) -> str:
    """A nats-server ``authorization { users: [...] }`` block: one user per role in ``users``
    (role -> credentials, e.g. ``{"user": "gateway", "password": "..."}`` or ``{"nkey": "U..."}``)
    with that role's permissions; ``extra``: more users as they are (an admin, a monitor)."""
    entries = [{**creds, "permissions": permissions(role, ns, models).to_dict()} for role, creds in users.items()]
    entries += [dict(e) for e in extra]
    body = ",\n    ".join(json.dumps(e) for e in entries)
    return f"authorization {{\n  users: [\n    {body}\n  ]\n}}\n"


# -- the Helm chart's copy ----------------------------------------------------------
# helm/pdmesh/files/nats-permissions.json is this table with placeholders the chart fills in
# (the namespace, the served model's token); tests/deploy checks it matches.
NS_PLACEHOLDER, MODEL_PLACEHOLDER = "__NS__", "__MODEL__"


def chart_table() -> dict:
    return {role: permissions(role, NS_PLACEHOLDER, [MODEL_PLACEHOLDER]).to_dict() for role in ROLES}


if __name__ == "__main__":  # python -m mesh.natsperms > helm/pdmesh/files/nats-permissions.json
    print(json.dumps(chart_table(), indent=2))
