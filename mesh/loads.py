"""Load reports, each worker's own or a process's together.

A worker publishes its ``LoadReport`` every ``load_interval`` on ``load`` (its own subject), and
every router, planner and ``mesh top`` reads every one: at 1,000 workers, 1,000 messages a second
into each of them, each a NATS delivery, a decode and a handler call. The decode workers of one
process (``worker.host``: ``mesh worker mock --num-workers N``, as on one host) tick together
(``procutil.until_tick``), so the process sends the reports of one tick as one ``LoadReports`` on
``loads`` instead (``LoadBatcher``): 1,000 workers in 8 processes are 8 messages a second. A worker
alone, and a prefill worker (the decode workers that take its jobs follow its own subject), still
sends its own.

Readers take both through ``subscribe_loads``, one report at a time, and judge each as before
(``Membership.vouches``): a report speaks for a member whichever message carried it, and only the
members' reports count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mesh.bus import Bus
from mesh.protocol import LoadReport, LoadReports

log = logging.getLogger(__name__)

MAX_REPORTS = 256  # reports per LoadReports (~600 bytes each: well inside its 1 MiB bound)


async def subscribe_loads(bus: Bus, handler: Callable[..., Awaitable[None]], expect: type = LoadReport,
                          together: type = LoadReports, on_together: Callable[..., Awaitable[None]] | None = None) -> list:
    """``handler(report, raw)`` for every worker's load report, sent alone or with its process's.
    ``expect``/``together``: the classes to decode them as (a reader may read fewer fields, as
    the router does: ``mesh.router.table.LoadSummary``). ``on_together(reports, raw)``: takes a
    process's message whole instead (the router: a thousand reports a second, one call each
    message). The subscriptions, to unsubscribe."""

    async def each(batch, raw) -> None:
        for report in batch.reports:
            await handler(report, raw)

    return [await bus.subscribe(bus.subjects.load_all(), handler, expect),
            await bus.subscribe(bus.subjects.loads_all(), on_together or each, together)]


class LoadBatcher:
    """The reports a process's decode workers hand in during one turn of the loop, sent as one
    ``LoadReports`` per model on ``loads.{host}`` once the turn is over."""

    def __init__(self, bus: Bus, host: str):
        self.bus = bus
        self.host = host  # the subject token of this process's messages
        self._pending: dict[str, list[LoadReport]] = {}
        self._scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self.sent = 0  # LoadReports messages

    def add(self, report: LoadReport) -> None:
        self._pending.setdefault(report.model, []).append(report)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send_soon)

    def _send_soon(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        task = asyncio.get_running_loop().create_task(self._send(pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, pending: dict[str, list[LoadReport]]) -> None:
        for model, reports in pending.items():
            subject = self.bus.subjects.loads(model, self.host)
            for at in range(0, len(reports), MAX_REPORTS):
                try:
                    await self.bus.publish(subject, LoadReports(reports[at:at + MAX_REPORTS]), traced=False)
                    self.sent += 1
                except Exception as e:  # the next tick's reports make good: a report is a state, not an event
                    log.warning("load reports of %s not sent: %s", self.host, e)
