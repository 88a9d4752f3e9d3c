"""docs/benchmarks.md is a results page: short, no work-log labels, a section for every benchmark
``python -m bench --list`` prints, and every figure with the command, date, commit and machine
that produced it (a "Measured DATE at `COMMIT` on MACHINE: `COMMAND`" line in its section)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench.common import registry

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()
MEASURED = re.compile(r"^(?:Measured|measured) (\d{4}-\d{2}-\d{2}) at `([0-9a-f]{7,40})` on (dev|H200)\b[^:`]*: `([^`]+)`", re.M)
NO_FIGURE = "No figure yet"
# work-log labels: a session's number ("s41"), its sittings and helpers; issue numbers are fine
LABELS = re.compile(r"\bs\d{2,3}\b|\bsessions?\b|\bsittings?\b|\bhelpers?\b", re.I)


def sections(level: str) -> dict[str, str]:
    parts = re.split(rf"^{level} (.+)$", PAGE, flags=re.M)
    return {parts[i].strip(): parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


def anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def test_the_page_is_at_most_600_lines_and_carries_no_work_log_labels():
    assert len(PAGE.splitlines()) <= 600
    assert not LABELS.findall(PAGE), sorted(set(LABELS.findall(PAGE)))


def test_every_listed_benchmark_has_a_section():
    titles = set(sections("###"))
    missing = [b.name for b in registry.collect() if b.name not in titles]
    assert not missing, f"no section in docs/benchmarks.md for {missing}"


@pytest.mark.parametrize("title", list(sections("###")))
def test_every_sections_figures_carry_a_command_a_date_and_a_commit(title):
    body = sections("###")[title]
    measured = MEASURED.findall(body)
    has_figures = bool(re.search(r"^\|.*\d.*\|$", body, re.M)) or re.search(r"\d+(\.\d+)?\s?(ms|us|s|x|%|GB/s)\b", body)
    if NO_FIGURE in body:
        assert not measured, f"{title}: says it has no figure, yet has a Measured line"
        return
    assert measured or not has_figures, f"{title}: figures without a 'Measured DATE at `COMMIT` on MACHINE: `CMD`' line"
    bench = registry.find(title)
    for _date, _commit, _machine, command in measured:
        if bench is not None:  # a listed benchmark's figures come from its own command
            assert re.match(rf"(sudo )?python -m bench {re.escape(bench.name)}\b", command), (title, command)
        else:
            assert command.startswith(("bash ", "GPU_CHECK")), (title, command)


def test_every_commit_named_is_in_the_history():
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() == "true":
        pytest.skip("no full git history here")
    for _date, commit, _machine, _command in MEASURED.findall(PAGE):
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        assert found.returncode == 0, f"commit {commit} is not in this repository's history"


def test_the_summary_rows_have_a_date_and_link_to_a_section():
    summary = sections("##")["Summary"]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith(("| measure", "|---"))]
    anchors = {anchor(t) for t in sections("###")}
    assert len(rows) >= len(registry.collect()) // 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|-", cells[3]), row
        link = re.fullmatch(r"\[[^\]]+\]\(#([a-z0-9-]+)\)", cells[4])
        assert link and link.group(1) in anchors, row
