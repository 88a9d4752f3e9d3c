"""The prefill work queue: decode workers publish ``PrefillJob``s, idle prefill workers pull.

A JetStream stream with work-queue retention holds the jobs; all prefill
workers of a model share one durable pull consumer, so each job goes to exactly
one worker, and only when that worker asks (``fetch``) for as many jobs as it
has room for. A busy worker is never handed more.
"""

from __future__ import annotations

import contextlib

from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType

from mesh.bus import Bus
from mesh.protocol import PrefillJob, encode
from mesh.registry import js_replicas
from mesh.tracing import outgoing_headers

JOB_MAX_AGE = 60.0  # a job nobody pulled within this is useless anyway (its decode worker fell back)


class PrefillQueue:
    def __init__(self, bus: Bus, model: str):
        self.bus = bus
        self.model = model
        self.subject = bus.subjects.prefill_jobs(model)
        self.stream = bus.subjects.prefill_stream(model)
        self._ensured = False

    async def ensure(self) -> None:
        if self._ensured:
            return
        try:
            await self.bus.js.stream_info(self.stream)
        except Exception:
            with contextlib.suppress(Exception):  # another worker may create it at the same moment
                await self.bus.js.add_stream(
                    name=self.stream, subjects=[self.subject], retention=RetentionPolicy.WORK_QUEUE,
                    storage=StorageType.MEMORY, max_age=JOB_MAX_AGE, num_replicas=js_replicas(self.bus),
                )
            await self.bus.js.stream_info(self.stream)
        self._ensured = True

    async def publish(self, job: PrefillJob, timeout: float = 2.0, span=None) -> None:
        await self.ensure()
        try:
            await self.bus.js.publish(self.subject, encode(job), timeout=timeout, headers=outgoing_headers(span=span))
        except Exception:
            self._ensured = False  # the server may have lost the stream (a restart): re-create it next time
            raise

    async def pull(self):
        """The shared pull subscription; ``await sub.fetch(n, timeout=...)`` takes up to n jobs."""
        self._ensured = False
        await self.ensure()
        durable = f"{self.stream}_workers"
        return await self.bus.js.pull_subscribe(
            self.subject, durable=durable, stream=self.stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_ack_pending=-1),
        )
