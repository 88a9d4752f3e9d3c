"""Load reports sent together (``mesh.loads``): a process's decode workers' reports of one tick
leave as one ``LoadReports``, and every reader takes each report as if it came alone."""

from __future__ import annotations

import asyncio

from mesh.bus import Bus
from mesh.loads import MAX_REPORTS, LoadBatcher, subscribe_loads
from mesh.protocol import LoadReport
from mesh.router.table import LoadSummaries, LoadSummary
from mesh.subjects import max_bytes


async def test_one_turn_of_reports_is_one_message_and_readers_take_each(nats_server):
    bus = await Bus.connect(nats_server.url, "loads-test", ns="lt")
    full: list[LoadReport] = []
    brief: list[LoadSummary] = []
    subjects: list[str] = []

    async def on_full(report, raw) -> None:
        full.append(report)

    async def on_brief(report, raw) -> None:
        brief.append(report)

    sizes: list[int] = []

    async def on_raw(msg) -> None:
        subjects.append(msg.subject)
        sizes.append(len(msg.data))

    try:
        await subscribe_loads(bus, on_full)
        await subscribe_loads(bus, on_brief, LoadSummary, LoadSummaries)  # the router's reading
        await bus.nc.subscribe("lt.>", cb=on_raw)
        await bus.flush(5)
        batcher = LoadBatcher(bus, "hostA")
        n = MAX_REPORTS + 44
        counters = {f"transport_{j}": j for j in range(16)}  # as a real worker's: a message past one report's bound
        for i in range(n):  # one turn of the loop: every worker of the process on one tick
            batcher.add(LoadReport(f"hostA-{i:04d}", "m", "decode", 1.0, running=i, kv_blocks_used=2 * i,
                                   counters=counters))
        await bus.publish(bus.subjects.load("m", "solo"), LoadReport("solo", "m", "decode", 1.0, running=7), traced=False)
        async with asyncio.timeout(10):
            while len(full) < n + 1 or len(brief) < n + 1:
                await asyncio.sleep(0.02)
        # two messages for the process (at most MAX_REPORTS each), one for the worker alone
        assert sorted(subjects) == ["lt.m.load.solo", "lt.m.loads.hostA", "lt.m.loads.hostA"] and batcher.sent == 2
        assert max(sizes) > max_bytes("LoadReport")  # read under LoadReports' bound, by the router's struct too
        assert {r.worker_id: r.running for r in full} == {**{f"hostA-{i:04d}": i for i in range(n)}, "solo": 7}
        assert {r.worker_id: r.kv_blocks_used for r in brief} == {**{f"hostA-{i:04d}": 2 * i for i in range(n)}, "solo": 0}
    finally:
        await bus.close()
