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

from collections.abc import Awaitable, Callable

from mesh.bus import Bus
from mesh.protocol import LoadReport, LoadReports
from mesh.together import TurnBatcher

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


class LoadBatcher(TurnBatcher):
    """The reports a process's decode workers hand in during one turn of the loop, sent as one
    ``LoadReports`` per model on ``loads.{host}`` once the turn is over (a report not sent: the next
    tick's makes good, a report is a state, not an event)."""

    def __init__(self, bus: Bus, host: str):
        super().__init__(bus, lambda model: bus.subjects.loads(model, host), LoadReports, MAX_REPORTS,
                         f"load reports of {host}")
