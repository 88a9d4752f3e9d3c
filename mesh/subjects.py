"""The subject table of the mesh: every NATS subject (and JetStream name), built in one place.

``mesh.protocol`` re-exports it; ``docs/protocol.md`` documents every subject.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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

    def embed(self, model: str, worker: str) -> str:
        """An embed worker's requests (``EmbedRequest``, answered with an ``EmbedReply``)."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.embed"

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

    def kv_batches(self, model: str, process: str) -> str:
        """The KV event batches of the decode workers of one process, together (``KvEventBatches``)."""
        return f"{self._m(model)}.kv.batches.{subject_token(process)}"

    def kv_batches_any(self) -> str:
        return f"{self.ns}.*.kv.batches.*"

    def kv_snapshot(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.kv.snapshot.{subject_token(worker)}"

    def load(self, model: str, worker: str) -> str:
        return f"{self._m(model)}.load.{subject_token(worker)}"

    def load_model(self, model: str) -> str:
        return f"{self._m(model)}.load.*"

    def load_all(self) -> str:
        return f"{self.ns}.*.load.*"

    def loads(self, model: str, process: str) -> str:
        """The reports of the decode workers of one process, together (``LoadReports``, ``mesh.loads``)."""
        return f"{self._m(model)}.loads.{subject_token(process)}"

    def loads_all(self) -> str:
        return f"{self.ns}.*.loads.*"

    def router_decisions(self) -> str:
        return f"{self.ns}.router.decisions"

    def planner_decisions(self) -> str:
        return f"{self.ns}.planner.decisions"

    def nccl(self, model: str, worker: str, verb: str) -> str:
        """The nccl transport's rendezvous and per-transfer handshake (verb: connect | begin)."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.nccl.{subject_token(verb)}"

    def nixl(self, model: str, worker: str, verb: str) -> str:
        """The nixl transport's handshake with ``worker`` (verb: md | begin): its agent metadata,
        and the grant of one write into its memory (``NixlBegin``)."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.nixl.{subject_token(verb)}"

    def lora(self, model: str) -> str:
        """Runtime LoRA load/unload: every worker of the model answers (a request gathers replies)."""
        return f"{self._m(model)}.lora"

    def control(self, worker: str) -> str:
        """Per-worker control (drain), used by the planner's local connector."""
        return f"{self.ns}.control.{subject_token(worker)}"

    def rank_join(self, worker: str) -> str:
        """A worker with ranks on other hosts: their joins (``RankJoin``, answered ``RankInvite``)."""
        return f"{self.ns}.ranks.{subject_token(worker)}.join"

    def workers_bucket(self) -> str:
        return f"{subject_token(self.ns)}_workers"

    def responses_bucket(self) -> str:
        """Stored responses of the Responses API (``gateway.responses.conversations``)."""
        return f"{subject_token(self.ns)}_responses"
    def files_bucket(self) -> str:
        """The object store of /v1/files (batch inputs, outputs and error files)."""
        return f"{subject_token(self.ns)}_files"

    def batches_bucket(self) -> str:
        """The key-value bucket of /v1/files' records and /v1/batches' state, leases and line results."""
        return f"{subject_token(self.ns)}_batches"

    def kv_fetch(self, model: str, worker: str) -> str:
        """Peer fetch (issue 20): a worker asks the holder ``worker`` for prefix blocks."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_fetch"

    def kv_fetch_data(self, model: str, worker: str, fetch_id: str) -> str:
        """A peer fetch's bytes over nats (``KvChunk``s) to the requester ``worker``."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_fetch_data.{subject_token(fetch_id)}"

    def kv_fetch_release(self, model: str, worker: str) -> str:
        """The requester -> the holder ``worker``: done reading a lent run (``KvFetchRelease``)."""
        return f"{self._m(model)}.decode.{subject_token(worker)}.kv_fetch_release"


# -- size bounds ----------------------------------------------------------------------------------
# The largest message of each type a receiver decodes (each subject carries one type; the subject
# table is above); bigger ones are dropped unread. Sized for the largest legitimate
# message: a prompt of ~1M tokens (5 bytes a token id), a nats KV chunk of the largest max_payload
# NATS allows, a snapshot page (``mesh.kvevents.SNAPSHOT_PAGE`` hashes), a step's chunks.
KIB, MIB = 1 << 10, 1 << 20
DEFAULT_MAX_BYTES = 64 * KIB  # control messages: Cancel, PrefillDone, decisions, LoRA, releases
MAX_BYTES: dict[str, int] = {
    "GenerateRequest": 8 * MIB, "PrefillJob": 8 * MIB,
    "TokenChunk": 1 * MIB, "TokenBatch": 4 * MIB,
    "KvEventBatch": 4 * MIB, "KvEventBatches": 4 * MIB, "KvSnapshot": 4 * MIB,
    "KvFetchRequest": 2 * MIB, "KvFetchDone": 2 * MIB,
    "KvChunk": 64 * MIB,  # bytes: decoded without growing
    "WorkerCard": 256 * KIB, "HostCards": 1 * MIB, "LoadReport": 64 * KIB, "LoadReports": 1 * MIB,
    "EmbedRequest": 8 * MIB, "EmbedReply": 64 * MIB,  # vectors as bytes: decoded without growing
}


def max_bytes(message: str | None) -> int:
    """The largest message of this type (its class name; None: any message) a receiver decodes."""
    if message is None:
        return max(MAX_BYTES.values())
    return MAX_BYTES.get(message, DEFAULT_MAX_BYTES)
