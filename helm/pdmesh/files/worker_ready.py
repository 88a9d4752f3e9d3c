"""Readiness of one pdmesh worker: exit 0 when its card is in the registry, "ready", and fresh.

The chart's exec readinessProbe runs this in the worker's own container (workers have
no HTTP port), as ``worker_ready.py ROLE``: it joins NATS as the worker does (its user,
credentials and TLS from the ``MESH_NATS_*`` environment, its role's inbox). It reads the
registry the way every router does: the card under ``{role}.{worker id}`` in the JetStream KV
bucket ``{ns}_workers``. Environment:

    MESH_NATS_URL (and MESH_NATS_CREDS, MESH_NATS_TLS_CA, ...), MESH_NS (default mesh),
    POD_NAME (the worker id: the chart passes ``--worker-id $(POD_NAME)``)

Exit 0: ready. Exit 1: no card, a draining worker, or a card older than the registry TTL
(the worker stopped refreshing it). Exit 2: NATS or the bucket cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from mesh.config import settings
from mesh.natsauth import NatsConfig, NatsError, open_connection
from mesh.protocol import DecodeError, Subjects, WorkerCard, decode, subject_token
from mesh.registry import DEFAULT_TTL


async def check(url: str, ns: str, worker_id: str, role: str = "", timeout: float = 3.0) -> tuple[int, str]:
    try:
        config = NatsConfig.build(url, role=role, connect_timeout=timeout)
        nc = await open_connection(config, "readiness-probe", allow_reconnect=False)
    except (NatsError, ValueError) as e:
        return 2, str(e)
    try:
        kv = await nc.jetstream(timeout=timeout).key_value(Subjects(ns).workers_bucket())
        entry = None
        for key in (f"{r}.{subject_token(worker_id)}" for r in ("decode", "prefill", "embed")):  # {role}.{id}
            with contextlib.suppress(KeyNotFoundError):
                entry = await kv.get(key)
                break
        if entry is None:
            raise KeyNotFoundError
    except (BucketNotFoundError, KeyNotFoundError):
        return 1, f"{worker_id} is not in the registry"
    except Exception as e:
        return 2, f"cannot read the registry: {type(e).__name__}: {e}"
    finally:
        await nc.close()
    try:
        card = decode(entry.value or b"", WorkerCard)
    except DecodeError as e:
        return 1, f"malformed card for {worker_id}: {e}"
    age = time.time() - card.updated
    if card.status != "ready":
        return 1, f"{worker_id} is {card.status}"
    if age > DEFAULT_TTL:
        return 1, f"the card of {worker_id} is {age:.0f}s old (TTL {DEFAULT_TTL:.0f}s)"
    return 0, f"{worker_id} ready: {card.role} {card.model}"


def main() -> int:
    s = settings()
    worker_id = os.environ.get("POD_NAME", "")
    if not s.nats_url or not worker_id:
        print("MESH_NATS_URL and POD_NAME must be set", file=sys.stderr)
        return 2
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    code, message = asyncio.run(check(s.nats_url, s.ns, worker_id, role))
    print(message, file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
