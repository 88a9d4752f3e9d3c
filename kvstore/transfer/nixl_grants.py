"""The receiving side of a kind of nixl write (``kvstore.transfer.nixl_agent``): the jobs a node's
memory takes writes for, each granted once to one writer and done when that writer's
notification came."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from kvstore.transfer.nixl_agent import NixlNode, agent_worker, notif_key, refuse

log = logging.getLogger(__name__)


class JobState(Enum):
    ARMED = 1  # params handed out: no write granted yet
    WRITING = 2  # a writer has its grant: bytes may land until its notification
    DONE = 3  # the notification came
    REVOKED = 4  # given up before any grant: none will be given
    ORPHANED = 5  # granted, and its writer's worker left the registry: nothing of it lands any more


@dataclass
class WriteJob:
    gen: int
    state: JobState = JobState.ARMED
    writer: str = ""


J = TypeVar("J", bound=WriteJob)


class Grants(Generic[J]):
    """The writes of one kind into a node's memory ("kv": the decode worker's pool; "fetch": a
    requester's fetch buffer). A job is armed with a fresh generation (``arm``), granted once to
    one writer (``NixlBegin``: the node asks ``grant``), and done when that writer's
    notification came (``landed``). Who holds the memory: the caller, until ``landed`` or a
    revoke before any grant (``revoke``)."""

    def __init__(self, node: NixlNode, kind: str):
        self.node, self.kind = node, kind
        self.jobs: dict[str, J] = {}
        self._gen = 0
        self.on_done: Callable[[str, bytes], None] | None = None  # (job id, payload) of a carried write
        node.writes[kind] = self

    def next_gen(self) -> int:
        self._gen = self._gen % (1 << 62) + 1
        return self._gen

    def grant(self, job_id: str, gen: int, agent: str) -> str | None:
        """Grant the job's write to ``agent``: None, or why not."""
        job = self.jobs.get(job_id)
        if job is None or job.gen != gen:
            return f"no such {self.kind} job armed (late, or forged)"
        if job.state is not JobState.ARMED:
            return f"the {self.kind} job is {job.state.name.lower()}"
        job.state, job.writer = JobState.WRITING, agent
        return None

    def carried(self, key: bytes, who: str, payload: bytes) -> None:
        """A notification with a payload came (``on_done`` is set): if it ends a job of ours,
        granted to ``who``, the job is DONE and ``on_done`` gets the payload (a forged or late one
        is dropped here; a writer's word over NATS still counts)."""
        job_id = key.decode(errors="replace").removeprefix(f"{self.kind}:").rpartition(":")[0]
        job = self.jobs.get(job_id)
        if job is None or notif_key(self.kind, job_id, job.gen) != key or job.state is not JobState.WRITING:
            return  # not ours (late, or forged): as a plain notification, it ends nothing
        if self.landed(job_id, job):
            self.on_done(job_id, payload)

    def landed(self, job_id: str, job: J) -> bool:
        """Has the writer's notification come (then the job is DONE)?"""
        if job.state is JobState.WRITING:
            who = self.node.take_notif(notif_key(self.kind, job_id, job.gen))
            # a writer of several ranks writes from an agent per rank: all of its worker's
            if who is not None and agent_worker(who) != agent_worker(job.writer):
                refuse("unknown_agent", f"a completion of {self.kind} {job_id} from {who!r}, not its writer")
            elif who is not None:
                job.state = JobState.DONE
        return job.state is JobState.DONE

    async def wait(self, job_id: str, job: J, timeout: float) -> bool:
        """Wait (up to ``timeout``) for a granted job's notification; False if it was never
        granted or did not come in time."""
        if self.landed(job_id, job):
            return True
        if job.state is not JobState.WRITING:
            return False
        await self.node.arrival(notif_key(self.kind, job_id, job.gen), timeout)
        return self.landed(job_id, job)

    def writer_left(self, worker_id: str) -> int:
        """The registry says worker ``worker_id`` left (its card was deleted, or expired: it has
        not refreshed it for the registry's TTL, seconds). Its granted jobs are ORPHANED: their
        blocks can be reused. Before that the agent is progressed once more, so that bytes of
        its write still in our socket land now, not in reused blocks (a dead process's last
        bytes arrive within milliseconds; the progress thread drained them long before the TTL).
        Returns how many jobs were orphaned."""
        self.node.poll_notifs()
        orphaned = 0
        for job_id, job in self.jobs.items():
            if job.state is JobState.WRITING and agent_worker(job.writer) == worker_id \
                    and not self.landed(job_id, job):
                job.state = JobState.ORPHANED
                self.node.unexpect(notif_key(self.kind, job_id, job.gen))
                orphaned += 1
        if orphaned:
            log.warning("nixl: writer %s left with %d %s write(s) granted: their memory is free again",
                        worker_id, orphaned, self.kind)
        return orphaned

    def revoke(self, job_id: str) -> bool:
        """No write will land any more: True for a job never granted (its grant is refused from
        now on) or one whose notification came; False while a granted write may still land."""
        job = self.jobs.get(job_id)
        if job is None:
            return True
        if job.state is JobState.ARMED:
            job.state = JobState.REVOKED
        return job.state is not JobState.WRITING or self.landed(job_id, job)
