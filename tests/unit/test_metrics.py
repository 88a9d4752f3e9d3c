"""A window of steps' metrics in one update: ``observe_counts`` exposes exactly what ``observe`` n times does."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mesh.metrics import observe_counts
from mesh.telemetry import LATENCY_BUCKETS


def _pair():
    reg = CollectorRegistry()
    one = Histogram("one_by_one", "x", ["model"], buckets=LATENCY_BUCKETS, registry=reg)
    many = Histogram("in_one_go", "x", ["model"], buckets=LATENCY_BUCKETS, registry=reg)
    return reg, one.labels("m"), many.labels("m")


def _samples(reg, name):
    return {(s.name.replace(name, ""), tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect() if m.name == name for s in m.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("amount", [0.0, 0.001, 0.0011, 0.0025, 0.7, 60.0, 61.0])
@pytest.mark.parametrize("count", [1, 2, 37])
def test_observe_counts_of_one_amount_equals_repeated_observe(amount, count):
    reg, one, many = _pair()
    for _ in range(count):
        one.observe(amount)
    observe_counts(many, {amount: count})
    assert _samples(reg, "one_by_one") == pytest.approx(_samples(reg, "in_one_go"), rel=1e-12)
    text = generate_latest(reg).decode()
    assert f'in_one_go_count{{model="m"}} {float(count)}' in text


def test_observe_counts_equals_repeated_observe():
    reg, one, many = _pair()
    counts = {0.0: 2, 0.001: 1, 0.0011: 5, 0.0025: 1, 0.7: 3, 60.0: 1, 61.0: 4}
    for amount, count in counts.items():
        for _ in range(count):
            one.observe(amount)
    observe_counts(many, counts)
    assert _samples(reg, "one_by_one") == pytest.approx(_samples(reg, "in_one_go"), rel=1e-12)


def test_a_choices_figures_flushed_once_equal_observe_per_batch():
    from gateway.metrics import ChoiceFigures
    from mesh.telemetry import REGISTRY

    reg, one, many = _pair()
    gaps = [0.0, 0.001, 0.0011, 0.0025, 0.0025, 0.7, 60.0, 61.0, 0.02]
    before = REGISTRY.get_sample_value("pdmesh_gateway_completion_tokens_total") or 0.0
    figures = ChoiceFigures(many)
    for g in gaps:
        one.observe(g)
        figures.gap(g)
        figures.tokens += 2
    assert _samples(reg, "in_one_go")[("_count", (("model", "m"),))] == 0  # nothing until the choice ends
    figures.flush()
    figures.flush()  # a second flush adds nothing
    assert _samples(reg, "one_by_one") == pytest.approx(_samples(reg, "in_one_go"), rel=1e-12)
    assert REGISTRY.get_sample_value("pdmesh_gateway_completion_tokens_total") == before + 2 * len(gaps)


def test_a_tally_hands_every_count_to_its_counter_in_few_updates(monkeypatch):
    """The token path's counters (gateway.metrics.Tally): each count reaches Prometheus, in one
    update per FLUSH_EVERY counts or FLUSH_S, and all of them before a scrape renders the page."""
    from prometheus_client import Counter

    import gateway.metrics as gm

    clock = [100.0]
    monkeypatch.setattr(gm.time, "monotonic", lambda: clock[0])
    reg = CollectorRegistry()
    counter = Counter("tallied", "x", registry=reg)
    updates = []
    real_inc = counter.inc
    monkeypatch.setattr(counter, "inc", lambda n=1: (updates.append(n), real_inc(n)))
    tally = gm.Tally(counter)
    for _ in range(gm.Tally.FLUSH_EVERY + 10):
        tally.inc()
    assert updates == [gm.Tally.FLUSH_EVERY]  # one update for 256 counts; 10 wait
    clock[0] += gm.Tally.FLUSH_S
    tally.inc(3)  # half a second on: handed over with what waited
    assert updates == [gm.Tally.FLUSH_EVERY, 13]
    tally.inc(2)
    gm.render(gm.workers_registry(dict))  # a scrape takes what waits
    assert updates[-1] == 2 and _samples(reg, "tallied") == {("_total", ()): gm.Tally.FLUSH_EVERY + 15}
    gm.Tally.ALL.remove(tally)
