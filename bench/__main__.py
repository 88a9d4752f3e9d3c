"""``python -m bench``: list the benchmarks, run one, or run every one's smoke mode."""

from __future__ import annotations

import sys

from bench.common import registry

USAGE = """usage: python -m bench --list | NAME [ARGS] | --smoke [NAME ...] [--report PATH]

  --list    every benchmark: name, area, about how long it runs here, what it measures, its target
  NAME      run it (python -m bench NAME --help: its arguments); its last line is its JSON result
  --smoke   each benchmark's quick or dry run in this one process (CI): the plumbing, not figures"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        for b in registry.collect():
            print(b.line())
        return 0
    if argv[0] == "--smoke":
        from bench.common.smoke import main as smoke

        return smoke(argv[1:])
    bench = registry.find(argv[0])
    if bench is None:
        print(f"python -m bench: no benchmark named {argv[0]!r} (python -m bench --list)", file=sys.stderr)
        return 2
    return bench.load().main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
