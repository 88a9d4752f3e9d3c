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
    # ... and the shm transport's copy waits this long under its write fence before it writes (a late copy)
    fault_kv_copy_delay_s: float = 0.0
    # NATS credentials and TLS (files), JetStream replicas; the --nats-* flags win over them
    nats_creds: str | None = None
    nats_nkey: str | None = None
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    nats_connect_timeout: float | None = None
    js_replicas: int | None = None
    # the gateway's API keys (comma-separated); --api-key and --api-key-file add to them
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()  # keys that may also load and unload LoRA adapters
    hash_key: str | None = None  # the mesh's block-hash secret, 64 hex digits; --hash-key-file wins


def _number(env, name: str, kind: type):
    value = env.get(name) or None
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a{'n integer' if kind is int else ' number'}") from None


@lru_cache(maxsize=1)
def settings() -> Settings:
    env = os.environ
    return Settings(
        nats_url=env.get("MESH_NATS_URL") or None,
        ns=env.get("MESH_NS", "mesh"),
        model=env.get("MESH_MODEL") or None,
        log_level=env.get("MESH_LOG_LEVEL", "WARNING"),
        fault_prefill_delay_s=float(env.get("MESH_FAULT_PREFILL_DELAY_S", "0") or 0),
        fault_kv_copy_delay_s=float(env.get("MESH_FAULT_KV_COPY_DELAY_S", "0") or 0),
        nats_creds=env.get("MESH_NATS_CREDS") or None,
        nats_nkey=env.get("MESH_NATS_NKEY") or None,
        nats_tls_ca=env.get("MESH_NATS_TLS_CA") or None,
        nats_tls_cert=env.get("MESH_NATS_TLS_CERT") or None,
        nats_tls_key=env.get("MESH_NATS_TLS_KEY") or None,
        nats_connect_timeout=_number(env, "MESH_NATS_CONNECT_TIMEOUT", float),
        js_replicas=_number(env, "MESH_JS_REPLICAS", int),
        api_keys=tuple(k.strip() for k in env.get("MESH_API_KEYS", "").split(",") if k.strip()),
        admin_api_keys=tuple(k.strip() for k in env.get("MESH_ADMIN_API_KEYS", "").split(",") if k.strip()),
        hash_key=env.get("MESH_HASH_KEY") or None,
    )
