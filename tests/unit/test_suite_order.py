"""The suite's module order (tests/helpers/order.py): longest module first, each module's own
order kept, unlisted modules at their layer's default, durations read back from a JUnit report."""

from __future__ import annotations

from dataclasses import dataclass

from tests.helpers.order import LAYER_DEFAULT, durations_from_junit, module_seconds, sort_items


@dataclass
class Item:
    nodeid: str


def test_the_longest_module_starts_first_and_each_module_keeps_its_order():
    ids = ["tests/unit/test_a.py::x", "tests/unit/test_a.py::y", "tests/integration/test_b.py::p[1]",
           "tests/e2e/test_c.py::q", "tests/integration/test_b.py::p[2]", "tests/unit/test_d.py::z"]
    items = [Item(i) for i in ids]
    sort_items(items, {"tests/unit/test_a.py": 100.0, "tests/e2e/test_c.py": 1.0})
    assert [i.nodeid for i in items] == [
        "tests/unit/test_a.py::x", "tests/unit/test_a.py::y",  # listed: 100 s
        "tests/integration/test_b.py::p[1]", "tests/integration/test_b.py::p[2]",  # unlisted integration
        "tests/unit/test_d.py::z",  # unlisted unit
        "tests/e2e/test_c.py::q"]  # listed: 1 s
    assert module_seconds("tests/integration/test_new.py", {}) == LAYER_DEFAULT["integration"]


def test_module_durations_are_summed_from_a_junit_report(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.integration.test_b" name="p[1]" time="2.5"/>'
        '<testcase classname="tests.integration.test_b" name="p[2]" time="1.0"/>'
        '<testcase classname="tests.unit.test_a.TestGroup" name="x" time="0.3"/>'
        '</testsuite></testsuites>')
    assert durations_from_junit(report) == {"tests/integration/test_b.py": 3.5, "tests/unit/test_a.py": 0.3}
