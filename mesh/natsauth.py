"""How a process joins NATS: the servers (one, or a cluster), credentials, TLS, JetStream replicas.

One frozen ``NatsConfig`` per process, built once from the flags and the
environment (``MESH_NATS_*``, read in ``mesh.config``; flags win) and checked
when it is built: a missing file or a bad combination is a one-line error
before anything connects.

    servers    --nats URL[,URL...]        several URLs: a cluster; the client picks one, fails over
    user/pass  nats://user:pass@host:4222 (or a token: nats://TOKEN@host:4222)
    creds      --nats-creds FILE          user JWT + nkey seed (operator/JWT mode; ``nsc generate creds``)
    nkey       --nats-nkey FILE           an nkey seed; the server lists the user by its public key
    TLS        --nats-tls-ca FILE         the CA that signed the servers' certificates (implies TLS)
               --nats-tls-cert/-key FILE  a client certificate, for servers that verify clients
    JetStream  --js-replicas N            replicas of the registry bucket and the prefill streams

``open_connection`` connects with these, retrying for ``connect_timeout``
seconds (a server that is still starting), and turns every way joining can
fail into one ``NatsError`` line that names the cause and the fix: nobody
listening, credentials refused, TLS refused, no JetStream. After the first
connection the client reconnects on its own, forever.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import nats.errors
import nats.js.errors
from nats.aio.client import Client

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMES = ("nats", "tls", "ws", "wss")
MAX_REPLICAS = 5  # JetStream's limit


# every variable that configures how a process joins NATS (mesh.config reads them)
ENV_NAMES = ("MESH_NATS_URL", "MESH_NATS_CREDS", "MESH_NATS_NKEY", "MESH_NATS_TLS_CA", "MESH_NATS_TLS_CERT",
             "MESH_NATS_TLS_KEY", "MESH_NATS_CONNECT_TIMEOUT", "MESH_JS_REPLICAS")


class NatsError(ConnectionError):
    """Could not join NATS. The message names the cause and the fix, in one line."""


def split_servers(urls: str) -> tuple[str, ...]:
    """``--nats`` as a tuple of URLs: comma-separated, blanks dropped, ``host:port`` means nats://."""
    out = []
    for raw in urls.split(","):
        url = raw.strip()
        if url:
            out.append(url if "://" in url else f"nats://{url}")
    return tuple(out)


def redact(url: str) -> str:
    """The URL without its password or token (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = "***" if parts.password is None else f"{parts.username}:***"
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


def _readable(path: str, flag: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    return str(p)


@dataclass(frozen=True)
class NatsConfig:
    servers: tuple[str, ...]
    creds: str | None = None
    nkey: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    js_replicas: int = 1
    connect_timeout: float = 10.0  # keep trying this long to make the first connection
    role: str = ""  # gateway, decode, prefill, planner: names the inbox prefix (_INBOX.{role})
    _ssl: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("--nats names no server")
        for url in self.servers:
            parts = urlsplit(url)
            if parts.scheme not in SCHEMES or not parts.hostname:
                raise ValueError(f"--nats {redact(url)}: not a NATS URL (nats://host:4222, tls://host:4222)")
            try:
                parts.port  # noqa: B018 (raises on a bad port)
            except ValueError:
                raise ValueError(f"--nats {redact(url)}: bad port") from None
        if self.creds and self.nkey:
            raise ValueError("--nats-creds and --nats-nkey are two ways to authenticate: give one")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        if not 1 <= self.js_replicas <= MAX_REPLICAS:
            raise ValueError(f"--js-replicas must be between 1 and {MAX_REPLICAS}")
        if self.connect_timeout <= 0:
            raise ValueError("--nats-connect-timeout must be > 0")
        if self.creds:
            text = Path(_readable(self.creds, "--nats-creds")).read_text(errors="replace")
            if "BEGIN NATS USER JWT" not in text or "BEGIN USER NKEY SEED" not in text:
                raise ValueError(f"--nats-creds {self.creds}: not a NATS creds file (a user JWT and an nkey seed)")
        if self.nkey:
            seed = Path(_readable(self.nkey, "--nats-nkey")).read_text(errors="replace").strip()
            if not seed.startswith("SU"):
                raise ValueError(f"--nats-nkey {self.nkey}: not a user nkey seed (it starts with SU)")
        for path, flag in ((self.tls_ca, "--nats-tls-ca"), (self.tls_cert, "--nats-tls-cert"),
                           (self.tls_key, "--nats-tls-key")):
            if path:
                _readable(path, flag)
        if self.wants_tls:
            object.__setattr__(self, "_ssl", self._ssl_context())

    @classmethod
    def build(cls, url: str, role: str = "", **flags) -> NatsConfig:
        """From ``--nats`` and the ``--nats-*`` flags (``None``: not given): flags win over the
        ``MESH_NATS_*`` environment."""
        from mesh.config import settings

        env = settings()
        defaults = {"creds": env.nats_creds, "nkey": env.nats_nkey, "tls_ca": env.nats_tls_ca,
                    "tls_cert": env.nats_tls_cert, "tls_key": env.nats_tls_key,
                    "js_replicas": env.js_replicas, "connect_timeout": env.nats_connect_timeout}
        values = {k: flags.get(k) if flags.get(k) is not None else v for k, v in defaults.items()}
        values = {k: v for k, v in values.items() if v is not None}
        return cls(servers=split_servers(url), role=role, **values)

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        """How to authenticate and replicate, as flags. Which servers (``--nats``) is the command's
        to say: ``mesh up`` starts one when none is given."""
        p.add_argument("--nats-creds", default=None, metavar="FILE", help="NATS user JWT + nkey seed ($MESH_NATS_CREDS)")
        p.add_argument("--nats-nkey", default=None, metavar="FILE", help="NATS nkey seed file ($MESH_NATS_NKEY)")
        p.add_argument("--nats-tls-ca", default=None, metavar="FILE",
                       help="CA of the NATS servers' certificates; implies TLS ($MESH_NATS_TLS_CA)")
        p.add_argument("--nats-tls-cert", default=None, metavar="FILE", help="TLS client certificate ($MESH_NATS_TLS_CERT)")
        p.add_argument("--nats-tls-key", default=None, metavar="FILE", help="its private key ($MESH_NATS_TLS_KEY)")
        p.add_argument("--nats-connect-timeout", type=float, default=None, metavar="SECONDS",
                       help="keep trying to reach NATS this long at start (default 10; $MESH_NATS_CONNECT_TIMEOUT)")
        p.add_argument("--js-replicas", type=int, default=None, metavar="N",
                       help="replicas of the JetStream bucket and streams this process creates (default 1; "
                            "3 on a 3-node cluster; $MESH_JS_REPLICAS)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, url: str, role: str = "") -> NatsConfig:
        """The servers at ``url`` with the flags of ``add_args`` (``build``: over the environment)."""
        return cls.build(url, role=role, creds=args.nats_creds, nkey=args.nats_nkey, tls_ca=args.nats_tls_ca,
                         tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key, js_replicas=args.js_replicas,
                         connect_timeout=args.nats_connect_timeout)

    def for_role(self, role: str) -> NatsConfig:
        return replace(self, role=role)

    @property
    def url(self) -> str:
        """``--nats`` as given (credentials included: never log it; see ``display``)."""
        return ",".join(self.servers)

    @property
    def display(self) -> str:
        return ",".join(redact(u) for u in self.servers)

    @property
    def wants_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert) or any(urlsplit(u).scheme in ("tls", "wss") for u in self.servers)

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.role}" if self.role else "_INBOX"

    def _ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except ssl.SSLError as e:
            raise ValueError(f"the NATS TLS files do not load ({e.reason or e}): check --nats-tls-ca, "
                             "--nats-tls-cert and --nats-tls-key (PEM)") from None
        return ctx

    def connect_options(self) -> dict:
        """Keyword arguments of ``nats.connect`` for the servers, credentials and TLS."""
        opts: dict[str, Any] = {"servers": list(self.servers), "inbox_prefix": self.inbox_prefix}
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey:
            opts["nkeys_seed"] = self.nkey
        if self._ssl is not None:
            opts["tls"] = self._ssl
        return opts

    def child_env(self) -> dict[str, str]:
        """The environment that gives a child process this configuration (the URL may hold a
        password: the environment, unlike a command line, is not readable by other users)."""
        env = {"MESH_NATS_URL": self.url, "MESH_JS_REPLICAS": str(self.js_replicas),
               "MESH_NATS_CONNECT_TIMEOUT": f"{self.connect_timeout:g}"}
        for name, value in (("MESH_NATS_CREDS", self.creds), ("MESH_NATS_NKEY", self.nkey),
                            ("MESH_NATS_TLS_CA", self.tls_ca), ("MESH_NATS_TLS_CERT", self.tls_cert),
                            ("MESH_NATS_TLS_KEY", self.tls_key)):
            if value:
                env[name] = str(Path(value).resolve())
        return env


# -- joining ------------------------------------------------------------------------


def _is_auth(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in text or \
        "authentication" in text


def _reset(e: BaseException) -> bool:
    return isinstance(e, (ConnectionResetError, BrokenPipeError, EOFError, nats.errors.UnexpectedEOF,
                          nats.errors.StaleConnectionError))


def _most_telling(errors: list[BaseException]) -> BaseException | None:
    """Of the errors of several attempts, the one that says most: refused credentials or TLS
    before a plain connection failure."""
    for test in (_is_auth, lambda e: isinstance(e, ssl.SSLError)):
        for e in reversed(errors):
            if test(e):
                return e
    return errors[-1] if errors else None


def explain(e: BaseException | None, config: NatsConfig) -> str:
    """One line: what went wrong joining NATS and what to do about it."""
    where = f"NATS at {config.display}"
    if e is None:
        return f"cannot reach {where} within {config.connect_timeout:g}s: is nats-server running there? " \
               "check --nats (MESH_NATS_URL)"
    if _is_auth(e):
        how = "--nats-creds" if config.creds else "--nats-nkey" if config.nkey else "the user:password or token in --nats"
        return f"{where} refused our credentials (authorization violation): check {how}, and that the " \
               "server knows this user"
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS to {where} failed: the server's certificate is not trusted ({e.verify_message}): pass " \
               "the CA that signed it with --nats-tls-ca, and use the host name the certificate names"
    if isinstance(e, ssl.SSLError):
        reason = e.reason or str(e)
        hint = "the server wants a client certificate: --nats-tls-cert and --nats-tls-key" \
            if "certificate required" in reason.lower() or "alert" in reason.lower() else \
            "check --nats-tls-ca, --nats-tls-cert and --nats-tls-key"
        return f"TLS to {where} failed ({reason}): {hint}"
    if "tls" in str(e).lower() and ("required" in str(e).lower() or "not available" in str(e).lower()):
        return f"TLS to {where} failed ({e}): use a tls:// URL with --nats-tls-ca, or turn TLS off on the server"
    detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return f"cannot reach {where} within {config.connect_timeout:g}s ({detail}): is nats-server running " \
           "there? check --nats (MESH_NATS_URL)"


async def open_connection(config: NatsConfig, name: str, error_cb=None, **callbacks) -> Client:
    """A connected client, or ``NatsError``. Credentials or TLS refused fail at once; a server
    nobody answers for is retried for ``config.connect_timeout`` seconds. ``error_cb`` and the
    other callbacks are nats-py's, for the life of the connection."""
    nc = Client()
    first_errors: list[BaseException] = []
    refused = asyncio.Event()
    connected = False

    async def on_error(e: Exception) -> None:
        if not connected:
            first_errors.append(e)
            # A server that wants credentials and drops the connection right after we sent ours
            # has refused them; its "-ERR Authorization Violation" can be lost in the TCP reset.
            if _reset(e) and (getattr(nc, "_server_info", None) or {}).get("auth_required"):
                first_errors[-1] = nats.errors.AuthorizationError()
            if _is_auth(first_errors[-1]) or isinstance(e, ssl.SSLError):
                refused.set()
            return
        if error_cb is not None:
            await error_cb(e)

    options = {"allow_reconnect": True, "max_reconnect_attempts": -1, **callbacks}
    attempt = asyncio.ensure_future(nc.connect(**config.connect_options(), name=name, error_cb=on_error, **options))
    give_up = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({attempt, give_up}, timeout=config.connect_timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        give_up.cancel()
    if attempt.done() and attempt.exception() is None:
        connected = True
        if config.wants_tls and not _is_tls(nc):
            await nc.close()
            raise NatsError(f"NATS at {config.display} did not start TLS although it was asked for "
                            "(--nats-tls-* or a tls:// URL): enable TLS on the server")
        return nc
    if attempt.done():
        first_errors.append(attempt.exception())
    else:
        attempt.cancel()
        with _suppress():
            await attempt
    with _suppress():
        await nc.close()
    raise NatsError(explain(_most_telling(first_errors), config))


def _is_tls(nc: Client) -> bool:
    transport = getattr(nc, "_transport", None)
    writer = getattr(transport, "_io_writer", None)
    return writer is not None and writer.get_extra_info("sslcontext") is not None


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, (Exception, asyncio.CancelledError))


JS_UNAVAILABLE_S = 300.0  # seconds a process keeps retrying a JetStream that answers "temporarily unavailable"
JS_RETRY_LOG_S = 5.0


def js_unavailable(e: BaseException) -> bool:
    """A JetStream that is on but cannot answer yet: a 503 with a description ("JetStream system
    temporarily unavailable"), or no answer in time (a cluster electing its leader, or a
    restarted node not caught up). A bare 503 is nats-py's "no responders" on the JetStream
    API: JetStream is off."""
    if isinstance(e, nats.js.errors.ServiceUnavailableError):
        return bool(e.description)
    return isinstance(e, nats.errors.TimeoutError | TimeoutError)


async def retry_unavailable(op: Callable[[], Awaitable[T]], what: str, limit: float = JS_UNAVAILABLE_S) -> T:
    """``await op()``, again while JetStream cannot answer yet (at start, a host's roles may come
    up before its cluster has a leader again), up to ``limit`` seconds; each attempt has the
    caller's own timeout. Logged every few seconds, not per attempt."""
    start = time.monotonic()
    last_log = start - JS_RETRY_LOG_S  # the first one at once
    while True:
        try:
            return await op()
        except Exception as e:
            if not js_unavailable(e) or time.monotonic() - start >= limit:
                raise
            if time.monotonic() - last_log >= JS_RETRY_LOG_S:
                last_log = time.monotonic()
                log.warning("%s: JetStream temporarily unavailable (%s), retrying", what,
                            getattr(e, "description", None) or "no answer")
        await asyncio.sleep(0.5)


async def check_jetstream(nc: Client, config: NatsConfig) -> None:
    """``NatsError`` unless JetStream answers on this connection: within ``connect_timeout``, or
    ``JS_UNAVAILABLE_S`` while it is only temporarily unavailable (a 503 saying so, or no answer
    from a clustered server whose INFO says it runs JetStream: a cluster still electing its
    leader, or a host's node restarting). The registry and the prefill queue live in it."""
    start = time.monotonic()
    deadline, last_log = start + config.connect_timeout, start - JS_RETRY_LOG_S
    info = getattr(nc, "_server_info", None) or {}
    # no answer from a clustered server that runs JetStream: a leader election (a standalone
    # one answers at once, unless this user may not ask: that stays a connect_timeout error)
    electing = bool(info.get("jetstream") and info.get("cluster"))
    while True:
        try:
            await nc.jetstream(timeout=max(0.5, min(2.0, deadline - time.monotonic()))).account_info()
            return
        except nats.errors.NoRespondersError:
            break  # nothing serves the JetStream API: it is off
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, TimeoutError) as e:
            unavailable = isinstance(e, nats.js.errors.ServiceUnavailableError)
            if unavailable and not js_unavailable(e):
                break  # nats-py's name for "no responders" on the JetStream API: it is off
            if unavailable or electing:  # on, not ready: wait for it longer than for a connection
                deadline = max(deadline, start + JS_UNAVAILABLE_S)
                if time.monotonic() - last_log >= JS_RETRY_LOG_S:
                    last_log = time.monotonic()
                    log.warning("NATS at %s: JetStream temporarily unavailable (%s), retrying", config.display,
                                getattr(e, "description", None) or "no answer")
        except nats.js.errors.APIError as e:
            if e.code != 503:
                raise NatsError(f"JetStream at {config.display} answered {e}: check this user's JetStream "
                                "permissions and limits") from None
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.2)
    raise NatsError(f"NATS at {config.display} has no JetStream (the worker registry and the prefill queue "
                    "live in it): start nats-server with -js (or jetstream {} in its config), or enable "
                    "JetStream for this account")
