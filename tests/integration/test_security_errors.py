"""Joining NATS fails clearly: every role, through the CLI as a subprocess, answers one line that
names the cause and the fix, exits non-zero, and prints no traceback.

    no JetStream          a nats-server without -js
    bad credentials       a wrong password in the URL, an nkey the server does not know
    TLS failure           a server certificate nobody trusts; a server without TLS when TLS is asked
    unreachable           nobody listens on the port
    bad flags             a missing creds file, cert without key, --js-replicas 9
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from mesh.natsserver import EmbeddedNats, free_port
from tests.helpers.cluster import Watcher

ROLES = {
    "worker": ["worker", "mock"],
    "gateway": ["gateway", "--port", "0"],
    "planner": ["planner"],
}


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**env, "TOKENIZERS_PARALLELISM": "false"})


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in lines if line.startswith("mesh: error: ")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w.lower() in errors[0].lower(), errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def no_jetstream():
    with EmbeddedNats(jetstream=False) as server:
        yield server


@pytest.fixture(scope="module")
def with_password():
    with EmbeddedNats(config='authorization { user: "mesh", password: "right" }\n') as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(d / "server.crt")
    cert.private_key_pem.write_to_path(d / "server.key")
    ca.cert_pem.write_to_path(d / "ca.pem")
    trustme.CA().cert_pem.write_to_path(d / "other-ca.pem")
    conf = f'tls {{ cert_file: "{d / "server.crt"}", key_file: "{d / "server.key"}" }}\n'
    with EmbeddedNats(config=conf, scheme="tls") as server:
        yield server, d


@pytest.mark.parametrize("role", ROLES)
def test_no_jetstream(role, no_jetstream):
    r = run_cli(*ROLES[role], "--nats", no_jetstream.url)
    one_line_error(r, "no JetStream", "-js")


@pytest.mark.parametrize("role", ROLES)
def test_wrong_password(role, with_password):
    url = f"nats://mesh:wrong@127.0.0.1:{with_password.port}"
    line = one_line_error(run_cli(*ROLES[role], "--nats", url), "refused our credentials", "user:password")
    assert "wrong" not in line  # the password is not printed


async def _card_of(url: str, worker_id: str) -> None:
    w = await Watcher.open(url)
    try:
        await w.wait_for(lambda: w.membership.get(worker_id), 60, f"{worker_id}'s card")
    finally:
        await w.close()


def test_right_password_then_serves(with_password, tmp_path):
    # the same server, the right password: the worker joins (its card is in the registry) and
    # runs until stopped
    url = f"nats://mesh:right@127.0.0.1:{with_password.port}"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "worker", "mock", "--nats", url, "--worker-id", "pw-ok",
                             "--metrics-port", "-1"], stderr=subprocess.PIPE, text=True)
    try:
        asyncio.run(_card_of(url, "pw-ok"))
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "error" not in err.lower(), err


def test_unknown_nkey(with_password, tmp_path):
    nkeys = pytest.importorskip("nkeys")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    (tmp_path / "user.nk").write_text(seed)
    r = run_cli("worker", "mock", "--nats", with_password.url, "--nats-nkey", str(tmp_path / "user.nk"))
    one_line_error(r, "refused our credentials", "--nats-nkey")


@pytest.mark.parametrize("role", ROLES)
def test_untrusted_server_certificate(role, tls_server):
    server, d = tls_server
    r = run_cli(*ROLES[role], "--nats", server.url, "--nats-tls-ca", str(d / "other-ca.pem"))
    one_line_error(r, "TLS", "not trusted", "--nats-tls-ca")


def test_trusted_certificate_connects(tls_server):
    server, d = tls_server
    r = run_cli("top", "--once", "--nats", server.url, "--nats-tls-ca", str(d / "ca.pem"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_tls_asked_of_a_server_without_it(with_password, tls_server):
    _, d = tls_server
    url = f"nats://mesh:right@127.0.0.1:{with_password.port}"
    one_line_error(run_cli("worker", "mock", "--nats", url, "--nats-tls-ca", str(d / "ca.pem")),
                   "did not start TLS")


@pytest.mark.parametrize("role", ROLES)
def test_unreachable(role):
    url = f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{free_port()}"  # a cluster nobody runs
    r = run_cli(*ROLES[role], "--nats", url, "--nats-connect-timeout", "1")
    one_line_error(r, "cannot reach", "nats-server running", "--nats")


@pytest.mark.parametrize(("flags", "words"), [
    (["--nats-creds", "/nonexistent.creds"], ["--nats-creds", "no such file"]),
    (["--nats-tls-cert", __file__], ["--nats-tls-key"]),
    (["--js-replicas", "9"], ["--js-replicas"]),
    (["--nats", "http://127.0.0.1:4222"], ["not a NATS URL"]),
])
def test_bad_flags(flags, words):
    args = ["worker", "mock", *([] if "--nats" in flags else ["--nats", "nats://127.0.0.1:4222"]), *flags]
    one_line_error(run_cli(*args), *words)
