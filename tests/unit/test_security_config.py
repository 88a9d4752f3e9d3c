"""The gateway's key ring and limits, without a network: key files, constant-time lookup, the
per-key token bucket, the body cap rule; and the NATS config's checks and redaction."""

from __future__ import annotations

import hmac

import pytest

from gateway import auth
from gateway.auth import AuthConfig, KeyLimits, KeyRing, _Usage, parse_key_line
from gateway.limits import body_cap, reply_buffer_limits
from mesh.natsauth import NatsConfig, redact, split_servers


def test_key_file_lines(tmp_path):
    default = KeyLimits(max_concurrent=2, rpm=0)
    assert parse_key_line("   # a comment", default, 1) is None
    assert parse_key_line("", default, 2) is None
    k = parse_key_line("sk-abc name=team-a rpm=60  # the analytics team", default, 3)
    assert k.name == "team-a" and k.limits == KeyLimits(max_concurrent=2, rpm=60)
    assert parse_key_line("sk-def", default, 4).name == "key-4"
    assert not k.admin and parse_key_line("sk-ops role=admin", default, 6).admin
    for bad, why in (("sk-x rpm=-1", "whole number"), ("sk-x burst=3", "unknown option"), ("sk-x rpm", "name=value"),
                     ("sk-x role=root", "role must be")):
        with pytest.raises(ValueError, match=why) as e:
            parse_key_line(bad, default, 5)
        assert "sk-x" not in str(e.value)  # an error never prints a key


def test_key_ring_sources_and_reload(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-file-1 name=one\nsk-file-2 max_concurrent=1\n")
    ring = KeyRing(AuthConfig(keys=("sk-flag",), admin_keys=("sk-admin",), key_file=str(f)))
    assert ring.match("sk-flag").name == "key-1" and not ring.match("sk-flag").admin
    assert ring.match("sk-admin").admin and not ring.match("sk-file-1").admin
    assert ring.match("sk-file-1").name == "one"
    assert ring.match("sk-file-2").limits.max_concurrent == 1
    assert ring.match("sk-nope") is None and ring.match("") is None
    f.write_text("sk-file-3\n")
    ring.reload()
    assert ring.match("sk-file-1") is None and ring.match("sk-file-3") is not None
    assert ring.match("sk-flag") is not None  # flag and environment keys stay
    f.write_text("sk-file-4 rpm=lots\n")  # a broken file keeps the keys we have
    ring.reload()
    assert ring.match("sk-file-3") is not None and ring.match("sk-file-4") is None
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="no key"):
        KeyRing(AuthConfig(key_file=str(empty)))


def test_a_changed_file_is_reread_without_a_signal(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("sk-1\n")
    ring = KeyRing(AuthConfig(key_file=str(f)))
    f.write_text("sk-2\n")
    ring.maybe_reload()  # checked at most every few seconds
    assert ring.match("sk-2") is None
    monkeypatch.setattr(auth, "RELOAD_CHECK", 0.0)
    import os
    os.utime(f, (1, 1))  # a new modification time, as a Secret update gives
    ring.maybe_reload()
    assert ring.match("sk-2") is not None and ring.match("sk-1") is None


def test_match_compares_every_key_in_constant_time(monkeypatch):
    keys = tuple(f"sk-{i:03d}" for i in range(50))
    ring = KeyRing(AuthConfig(keys=keys))
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented in ("sk-000", "sk-049", "sk-0", "x" * 100):
        calls.clear()
        ring.match(presented)
        assert len(calls) == len(keys)  # no early exit on a match or a mismatch
        # digests of equal length whatever the presented key: no length leak either
        assert len(auth._digest(presented)) == 32


def test_token_bucket_and_concurrency(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    limits = KeyLimits(max_concurrent=0, rpm=3)
    u = _Usage(limits.rpm)
    assert [u.take(limits) for _ in range(3)] == [None, None, None]
    what, limit, wait = u.take(limits)
    assert (what, limit) == ("requests per minute", 3) and wait == pytest.approx(20.0)
    now[0] += 20.0  # one request's worth refilled
    assert u.take(limits) is None and u.take(limits) is not None
    c = KeyLimits(max_concurrent=2)
    u = _Usage(0)
    u.inflight = 2
    assert u.take(c)[0] == "concurrent requests"
    u.inflight = 1
    assert u.take(c) is None


def test_body_cap_rule():
    assert body_cap(0) == 1 << 20
    ids_128k = len(",".join(["131071"] * 131072)) + 200  # a full 128k-token prompt as JSON ids
    assert body_cap(131072) > ids_128k
    assert body_cap(131072) < 4 << 20  # not the 32 MiB of before
    msgs, nbytes = reply_buffer_limits(1024)
    assert msgs == 1024 * 1024 and nbytes == 256 << 20  # was 1M messages, 1 GiB, whatever was admitted
    assert reply_buffer_limits(1) < reply_buffer_limits(2)


def test_nats_config_checks_and_redacts(tmp_path):
    assert split_servers("a:4222, nats://b:4222,,tls://c:4222") == (
        "nats://a:4222", "nats://b:4222", "tls://c:4222")
    assert redact("nats://u:secret@h:4222") == "nats://u:***@h:4222"
    assert redact("nats://tok@h:4222") == "nats://***@h:4222"
    c = NatsConfig(servers=("nats://u:secret@h:4222", "nats://h2:4222"), js_replicas=3, role="decode")
    assert "secret" not in c.display and c.inbox_prefix == "_INBOX.decode"
    assert c.child_env()["MESH_NATS_URL"] == "nats://u:secret@h:4222,nats://h2:4222"
    assert c.connect_options()["inbox_prefix"] == "_INBOX.decode"
    seed = tmp_path / "u.nk"
    seed.write_text("SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU\n")
    assert NatsConfig(servers=("nats://h:4222",), nkey=str(seed)).connect_options()["nkeys_seed"] == str(seed)
    for kwargs, words in ((dict(creds=str(seed)), "not a NATS creds file"), (dict(nkey=str(tmp_path / "x")), "no such file"),
                          (dict(tls_cert=str(seed)), "go together"), (dict(js_replicas=0), "between 1"),
                          (dict(creds=str(seed), nkey=str(seed)), "give one")):
        with pytest.raises(ValueError, match=words):
            NatsConfig(servers=("nats://h:4222",), **kwargs)
    with pytest.raises(ValueError, match="not a NATS URL") as e:
        NatsConfig(servers=("http://u:pw@h:4222",))
    assert "pw" not in str(e.value)
