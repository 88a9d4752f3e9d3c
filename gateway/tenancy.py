"""What a request's API key decides beyond letting it in: its cache scope and its priority.

Cache scope (issue 32): a prefix is reused only among requests of one scope, the key's cache
owner (its ``cache_group``, else its ``tenant``, else the key itself) and the request's
``cache_salt``. The gateway sends a keyed digest of the two as ``GenerateRequest.cache_scope``
(neither the tenant's name nor the salt goes on the bus); workers and the router put it in the
block-hash seed, so ``usage.prompt_tokens_details.cached_tokens`` counts only the scope's own
blocks. Without API keys the mesh is one tenant: the scope is the salt's alone ("" without one).

Priority: a key asks for at most its ``max_priority`` (default 0, so only operators' chosen keys
can jump the queue; admin keys are unbounded unless their line says otherwise); a higher one is
lowered to it, not refused. Without API keys there is no clamp (one tenant trusts itself).
"""

from __future__ import annotations

import hashlib

from gateway.auth import ApiKey
from gateway.errors import APIError
from kvstore.hashing import HashKey
from mesh import metrics


def cache_scope(hash_key: HashKey, key: ApiKey | None, salt: str | None) -> str:
    """The scope id of a request with API key ``key`` (None: keys are off) and ``cache_salt``."""
    owner = key.cache_owner if key is not None else ""
    if not owner and not salt:
        return ""
    material = f"{owner}\x00{salt or ''}".encode()
    return hashlib.blake2b(material, key=hash_key.secret, person=b"pdmesh-scope", digest_size=16).hexdigest()


def clamp_priority(priority: int, key: ApiKey | None) -> int:
    """``priority`` as far as ``key`` may ask (keys off or an unbounded key: as sent)."""
    if key is None or key.max_priority is None or priority <= key.max_priority:
        return priority
    metrics.GATEWAY_PRIORITY_CLAMPED.inc()
    return key.max_priority


PRIORITY_NAMES = {"interactive": 0, "batch": -1}  # x-priority's names (the Batch API sends an integer)


def header_priority(header: str) -> int:
    """An ``x-priority`` header's priority: interactive, batch or a 32-bit integer; empty: 0."""
    header = header.strip().lower()
    if not header:
        return 0
    if header in PRIORITY_NAMES:
        return PRIORITY_NAMES[header]
    try:
        value = int(header)
    except ValueError:
        raise APIError(400, "x-priority must be interactive, batch or an integer", "x-priority") from None
    if not -(1 << 31) <= value < (1 << 31):
        raise APIError(400, "x-priority is out of range", "x-priority")
    return value
