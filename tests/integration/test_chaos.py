"""A short chaos run (12 s; `python -m bench chaos --seconds 120` is the long one): steady load
while workers are killed and restarted at random and NATS restarts once. No request may hang or
return wrong tokens."""

from __future__ import annotations

from bench.mesh.chaos import report, run_chaos


async def test_chaos_loses_nothing_and_hangs_nothing():
    seconds = 12.0
    out = await run_chaos(seconds=seconds, clients=6, kill_every=1.2, request_timeout=60.0, seed=1)
    print(report(out, seconds))
    assert out.kills >= 5 and out.total >= 100
    assert out.hung == 0
    assert out.incorrect == 0, out.incorrect_samples
    assert out.correct >= 0.5 * out.total  # most requests ride through the faults
    assert out.migrations is not None and out.reroutes is not None  # the gateway counts both
    assert any(t0 <= f <= t1 for t0, t1 in out.spans for f in out.faults)  # faults hit requests in flight
