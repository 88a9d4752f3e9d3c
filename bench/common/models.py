"""The generated models the benchmarks run (``engine.tiny``: random weights, a real tokenizer).

A size is written once into ``~/.cache/pdmesh/bench-SIZE`` (``$XDG_CACHE_HOME``) and reused, so a
benchmark's first run pays for the write and the next ones do not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def generated(size: str) -> Path:
    """The ``size`` model of ``engine.tiny.SIZES`` (``tiny``, ``small``, ``moe``, ``small-moe``)."""
    from engine.tiny import write_tiny_model

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdmesh" / f"bench-{size}"
    if not (cache / "model.safetensors").is_file():
        print(f"writing the {size} model to {cache} ...", file=sys.stderr)
        write_tiny_model(cache, size=size, seed=0)
    return cache


def model_dir(spec: str | None, default: str = "small") -> Path:
    """``--model``: a generated size by name, or a model directory (None: the ``default`` size)."""
    from engine.tiny import SIZES

    if spec is None or spec in SIZES:
        return generated(spec or default)
    path = Path(spec)
    if not (path / "config.json").is_file():
        sys.exit(f"--model {spec}: neither a model directory (no config.json) nor one of {', '.join(SIZES)}")
    return path
