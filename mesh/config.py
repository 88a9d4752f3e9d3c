"""Process-wide settings from the environment: read once, in one place, prefix ``MESH_``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Settings:
    nats_url: str | None
    ns: str
    model: str | None
    log_level: str
    # Fault injection for tests and chaos runs: a prefill worker waits this long before each transfer.
    fault_prefill_delay_s: float = 0.0


@lru_cache(maxsize=1)
def settings() -> Settings:
    env = os.environ
    return Settings(
        nats_url=env.get("MESH_NATS_URL") or None,
        ns=env.get("MESH_NS", "mesh"),
        model=env.get("MESH_MODEL") or None,
        log_level=env.get("MESH_LOG_LEVEL", "WARNING"),
        fault_prefill_delay_s=float(env.get("MESH_FAULT_PREFILL_DELAY_S", "0") or 0),
    )
