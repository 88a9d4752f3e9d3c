"""API keys and request bounds at the gateway's door: ASGI middleware in front of the app.

    request --> ApiKeys (401, 429) --> BodyCap (413) --> the app

``ApiKeys``: with at least one key configured, every route but ``/health`` and
``/live`` (and ``/metrics``, unless ``metrics_auth``) needs
``Authorization: Bearer KEY``; otherwise 401 in OpenAI's error shape. A key
may carry limits (concurrent requests, requests per minute), answered with 429
and ``Retry-After``. Keys come from ``--api-key``, ``MESH_API_KEYS`` and
``--api-key-file`` (one per line: ``KEY [name=LABEL] [max_concurrent=N]
[rpm=N] [role=admin] [tenant=NAME] [cache_group=NAME] [max_priority=N]``; ``#``
comments), the file reread on SIGHUP and when it changes (a mounted Kubernetes
Secret). A key's tenant (default: the key itself) owns its prefix cache, shared
with keys of the same ``cache_group``; ``max_priority`` (default 0, admin keys
unbounded) caps the priority it may ask for (``gateway/tenancy.py``). Keys are held as SHA-256 digests and
every presented key is compared with all of them in constant time. The key a
request came with is in ``scope["state"]["api_key"]`` (``request.state.api_key``):
``require_admin`` refuses the admin routes (adapter loading) to keys without
``role=admin`` (403), and ``--admin-api-key`` / ``MESH_ADMIN_API_KEYS`` add
admin keys outside the file.

``BodyCap``: request bodies are capped by what the largest model served can
take (``body_cap``): 16 bytes per token of its context plus 1 MiB. A prompt
of N tokens is at most ~7 bytes a token as JSON token ids and ~4 bytes a token
as ASCII text (up to ~12 escaped non-ASCII), so a full-context prompt always
fits, with room for the rest of the request; a batch of prompts larger than
that is split by the client. Unauthenticated requests are refused before their
body is read. File uploads (``/v1/files``) are capped by their route instead
(``--batch-max-file-bytes``).

Who releases what: a request's concurrency slot is taken after the key checks
pass and released when the app returns (the whole response sent, streamed or
not, or the client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import APIError
from gateway.limits import body_cap
from mesh import metrics

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/live")
OWN_CAPS = ("/v1/files",)  # routes that cap their bodies themselves (uploads: --batch-max-file-bytes)
RELOAD_CHECK = 5.0  # seconds between checks of the key file's modification time


@dataclass(frozen=True)
class KeyLimits:
    max_concurrent: int = 0  # requests in flight at once (0: no limit)
    rpm: int = 0  # requests per minute (0: no limit)


ROLES = ("user", "admin")  # admin: also the admin routes (loading and unloading LoRA adapters)


@dataclass(frozen=True)
class ApiKey:
    name: str  # what logs say (never the key)
    digest: bytes  # SHA-256 of the key
    limits: KeyLimits
    role: str = "user"
    tenant: str = ""  # whose prefix cache the key uses; "": its own (named by its digest)
    cache_group: str = ""  # keys with the same group share one prefix cache across their tenants
    # The highest priority the key may ask for (a higher one is lowered to it); None: unbounded
    max_priority: int | None = 0

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def cache_owner(self) -> str:
        """Who owns the key's prefix cache: its group, else its tenant, else the key itself (by a
        digest of its digest: never the key)."""
        if self.cache_group:
            return f"group:{self.cache_group}"
        return f"tenant:{self.tenant}" if self.tenant else f"key:{hashlib.sha256(self.digest).hexdigest()[:32]}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


KEY_OPTIONS = "name, max_concurrent, rpm, role, tenant, cache_group, max_priority"


def parse_key_line(line: str, default: KeyLimits, index: int) -> ApiKey | None:
    """One line of a key file: ``KEY [name=LABEL] [max_concurrent=N] [rpm=N] [role=user|admin]
    [tenant=NAME] [cache_group=NAME] [max_priority=N]``; None for a blank or comment line.
    ValueError names what is wrong (never the key itself)."""
    line = line.split("#", 1)[0].strip()
    if not line:
        return None
    key, *options = line.split()
    text = {"name": f"key-{index}", "role": "user", "tenant": "", "cache_group": ""}
    limits = {"max_concurrent": default.max_concurrent, "rpm": default.rpm}
    max_priority: int | None = None
    for opt in options:
        k, sep, v = opt.partition("=")
        if not sep:
            raise ValueError(f"line {index}: {opt!r} is not name=value")
        if k in text:
            if k == "role" and v not in ROLES:
                raise ValueError(f"line {index}: role must be one of {', '.join(ROLES)}")
            text[k] = v
        elif k in limits:
            if not v.isdigit():
                raise ValueError(f"line {index}: {k} must be a whole number >= 0")
            limits[k] = int(v)
        elif k == "max_priority":
            if not v.removeprefix("-").isdigit() or not -(1 << 31) <= int(v) < (1 << 31):
                raise ValueError(f"line {index}: max_priority must be an integer (a 32-bit one)")
            max_priority = int(v)
        else:
            raise ValueError(f"line {index}: unknown option {k!r} ({KEY_OPTIONS})")
    if max_priority is None:  # admin keys: unbounded unless the line bounds them
        max_priority = None if text["role"] == "admin" else 0
    return ApiKey(text["name"], _digest(key), KeyLimits(**limits), text["role"], text["tenant"],
                  text["cache_group"], max_priority)


@dataclass
class AuthConfig:
    """The gateway's keys and their default limits (``mesh gateway`` flags)."""

    keys: tuple[str, ...] = ()  # --api-key and MESH_API_KEYS
    admin_keys: tuple[str, ...] = ()  # --admin-api-key and MESH_ADMIN_API_KEYS: role admin
    key_file: str | None = None  # --api-key-file
    limits: KeyLimits = field(default_factory=KeyLimits)  # for every key without its own
    metrics_auth: bool = False  # /metrics needs a key too

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys or self.key_file)


class KeyRing:
    """The valid keys; ``match`` looks one up in constant time."""

    def __init__(self, config: AuthConfig):
        self.config = config
        self._fixed = [ApiKey(f"key-{i}", _digest(k), config.limits) for i, k in enumerate(config.keys, 1)
                       if k.strip()]
        self._fixed += [ApiKey(f"admin-{i}", _digest(k), config.limits, "admin", max_priority=None)
                        for i, k in enumerate(config.admin_keys, 1) if k.strip()]
        self._from_file: list[ApiKey] = []
        self._mtime = 0.0
        self._checked = time.monotonic()
        self.reload_wanted = False
        if config.key_file:
            self._from_file = self._read_file()  # errors here stop the gateway: a bad file at start
        if not self.keys:
            raise ValueError("API keys are on (--api-key-file) but no key is configured: the file has none")

    @property
    def keys(self) -> list[ApiKey]:
        return self._fixed + self._from_file

    def _read_file(self) -> list[ApiKey]:
        path = Path(self.config.key_file)
        try:
            self._mtime = path.stat().st_mtime
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
        out = []
        for i, line in enumerate(lines, 1):
            key = parse_key_line(line, self.config.limits, i)
            if key is not None:
                out.append(key)
        return out

    def reload(self) -> None:
        """Reread the key file; a file that does not read or parse keeps the keys we have."""
        self.reload_wanted = False
        if not self.config.key_file:
            return
        try:
            keys = self._read_file()
        except ValueError as e:
            log.error("API keys not reloaded, keeping the %d we have: %s", len(self.keys), e)
            return
        self._from_file = keys
        log.warning("API keys reloaded from %s: %d keys", self.config.key_file, len(self.keys))

    def maybe_reload(self) -> None:
        """On request: after SIGHUP, or when the file changed (checked every few seconds)."""
        now = time.monotonic()
        if not self.reload_wanted and (not self.config.key_file or now - self._checked < RELOAD_CHECK):
            return
        self._checked = now
        with contextlib.suppress(OSError):
            if not self.reload_wanted and os.stat(self.config.key_file).st_mtime == self._mtime:
                return
        self.reload()

    def match(self, presented: str) -> ApiKey | None:
        """The key ``presented`` is, or None; time independent of which key matched or how close
        a wrong one came (every digest is compared, with ``hmac.compare_digest``)."""
        digest = _digest(presented)
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


class _Usage:
    """One key's requests in flight and its token bucket (capacity ``rpm``, refilled ``rpm``/min)."""

    __slots__ = ("inflight", "stamp", "tokens")

    def __init__(self, rpm: int):
        self.inflight = 0
        self.tokens = float(rpm)
        self.stamp = time.monotonic()

    def take(self, limits: KeyLimits) -> tuple[str, int, float] | None:
        """None if the request may go, else (what is over, its limit, seconds to wait)."""
        if limits.max_concurrent and self.inflight >= limits.max_concurrent:
            return "concurrent requests", limits.max_concurrent, 1.0
        if limits.rpm:
            now = time.monotonic()
            self.tokens = min(float(limits.rpm), self.tokens + (now - self.stamp) * limits.rpm / 60.0)
            self.stamp = now
            if self.tokens < 1.0:
                return "requests per minute", limits.rpm, (1.0 - self.tokens) * 60.0 / limits.rpm
            self.tokens -= 1.0
        return None


async def _respond(scope, send, error: APIError, count: Callable) -> None:
    count(scope, error.status)
    await error.response()(scope, _no_receive, send)


async def _no_receive():  # a JSONResponse never reads the request
    return {"type": "http.disconnect"}


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class ApiKeys:
    """ASGI middleware: 401 without a valid key, 429 past a key's limits."""

    def __init__(self, app, keys: KeyRing, count: Callable = lambda scope, status: None):
        self.app = app
        self.keys = keys
        self.count = count
        self.usage: dict[bytes, _Usage] = {}
        self._hooked = False

    def _protected(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.keys.config.metrics_auth

    def _hook_sighup(self) -> None:
        self._hooked = True
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self) -> None:
        self.keys.reload_wanted = True
        self.keys.maybe_reload()

    async def __call__(self, scope, receive, send) -> None:
        if not self._hooked and scope["type"] in ("lifespan", "http"):
            self._hook_sighup()
        if scope["type"] != "http" or not self._protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        self.keys.maybe_reload()
        presented = _bearer(scope)
        key = self.keys.match(presented) if presented is not None else None
        if key is None:
            reason = "missing_key" if presented is None else "invalid_key"
            metrics.GATEWAY_REJECTED.labels(reason).inc()
            message = ("missing API key: send it as Authorization: Bearer KEY" if presented is None else
                       "incorrect API key provided")
            await _respond(scope, send, APIError(401, message, code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"}), self.count)
            return
        usage = self.usage.get(key.digest)
        if usage is None:
            usage = self.usage[key.digest] = _Usage(key.limits.rpm)
        over = usage.take(key.limits)
        if over is not None:
            what, limit, wait = over
            metrics.GATEWAY_REJECTED.labels("key_concurrency" if what.startswith("conc") else "key_rpm").inc()
            await _respond(scope, send, APIError(
                429, f"rate limit reached for this API key: {limit} {what}; retry in {math.ceil(wait)}s",
                code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(wait))}), self.count)
            return
        usage.inflight += 1
        scope.setdefault("state", {})["api_key"] = key  # request.state.api_key: require_admin reads it
        try:
            await self.app(scope, receive, send)
        finally:
            usage.inflight -= 1


class BodyCap:
    """ASGI middleware: 413 for a body over ``body_cap(largest context served)``, declared or sent."""

    def __init__(self, app, max_model_len: Callable[[], int], count: Callable = lambda scope, status: None):
        self.app = app
        self.max_model_len = max_model_len
        self.count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH") or \
                scope.get("path") in OWN_CAPS:
            await self.app(scope, receive, send)
            return
        cap = body_cap(self.max_model_len())
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > cap:
            await self._too_large(scope, send, cap, self.count)
            return
        parts, size, first = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it too
                first = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await self._too_large(scope, send, cap, self.count)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        pending = [first or {"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(scope, send, cap: int, count: Callable) -> None:
        metrics.GATEWAY_REJECTED.labels("body_too_large").inc()
        await _respond(scope, send, APIError(413, f"the request body is over {cap} bytes (1 MiB plus 16 bytes per "
                                           "token of the largest context served); split a large batch"), count)


async def require_admin(request) -> None:
    """The admin routes' check once API keys are on (``app.state.require_admin``): the request's
    key (ApiKeys let it in) must have ``role=admin``; 403 otherwise."""
    key: ApiKey | None = request.scope.get("state", {}).get("api_key")
    if key is None or not key.admin:
        metrics.GATEWAY_REJECTED.labels("not_admin").inc()
        raise APIError(403, "this API key may not manage adapters: it needs role=admin (an admin key from "
                            "--admin-api-key, MESH_ADMIN_API_KEYS or role=admin in the key file)",
                       code="permission_denied")


ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


def guard(app, gateway, auth: AuthConfig | None = None):
    """``app`` behind the body cap and, when keys are configured, the API keys. Their refusals of
    the completion routes count in ``pdmesh_gateway_requests_total`` like the app's own."""
    def count(scope, status: int) -> None:
        endpoint = ENDPOINTS.get(scope.get("path", ""))
        if endpoint is not None:
            gateway.stats.request(endpoint, status)

    app = BodyCap(app, largest_context(gateway), count)
    if auth is not None and auth.enabled:
        app = ApiKeys(app, KeyRing(auth), count)
    return app


def largest_context(gateway) -> Callable[[], int]:
    """The largest ``max_model_len`` over the models ``gateway`` serves now."""
    def largest() -> int:
        models: Iterable[str] = gateway.live_models() if gateway.membership is not None else ()
        return max((gateway.max_model_len(m) for m in models), default=0)

    return largest
