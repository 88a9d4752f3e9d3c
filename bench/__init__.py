"""pdmesh's benchmarks, one entry point:

    python -m bench --list              # every benchmark: name, area, about how long, what it measures, target
    python -m bench NAME [ARGS]         # run one (NAME --help: its arguments)
    python -m bench --smoke [NAME...]   # every benchmark's quick or dry run (what CI runs)

Each benchmark ends by printing one JSON object, its last line: the figures, the machine and the
commit (``bench/common/report.py``). The folders say what a benchmark measures: ``serving/`` the
gateway and the token path, ``engine/`` the model engine, ``kv/`` KV transfer, tiers and reuse,
``mesh/`` routing, planning and failures across processes and hosts, ``gpu/`` CUDA only.
docs/benchmarks.md has today's figures and the command behind each.
"""
