"""NATS with one user per role and least-privilege permissions (``mesh.natsperms``), for real.

A nats-server runs with an authorization block rendered from the permission table: the gateway
logs in with a password in its URL, the workers and the planner with nkeys. The mesh (a real
decode and prefill worker on the tiny model, KV over the ``nats`` transport so every subject of
a disaggregated request is used, the gateway, a planner) serves requests through the official
``openai`` client, and the server logs no permission violation at all: the table is complete.
Then a worker's own credentials try what only a gateway may do (send a ``GenerateRequest``) or
read what only a gateway may read, and the server refuses both. Last, operator (JWT) mode: a
worker joins with a creds file whose user JWT carries its role's permissions.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import time
from pathlib import Path

import nats
import nkeys
import openai
import pytest

from mesh.bus import Bus
from mesh.natsauth import NatsConfig
from mesh.natsperms import authorization_block, lora_reply_inbox, permissions
from mesh.natsserver import EmbeddedNats, free_port
from mesh.protocol import GenerateRequest, SamplingOptions, TokenChunk, encode
from mesh.registry import Membership
from tests.helpers.cluster import Cluster, Watcher, wait_http_ok

MODEL = "tiny"
GATEWAY_PASSWORD = secrets.token_urlsafe(16)
ADMIN_PASSWORD = secrets.token_urlsafe(16)


def new_user_nkey() -> tuple[str, str]:
    """(seed, public key) of a fresh user nkey."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    return seed, nkeys.from_seed(bytearray(seed.encode())).public_key.decode()


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secure-nats")
    seeds = {}
    users: dict[str, dict] = {"gateway": {"user": "gateway", "password": GATEWAY_PASSWORD}}
    for role in ("decode", "prefill", "planner"):
        seed, public = new_user_nkey()
        (d / f"{role}.nk").write_text(seed + "\n")
        seeds[role] = d / f"{role}.nk"
        users[role] = {"nkey": public}
    config = authorization_block(users, ns="mesh", models=[MODEL],
                                 extra=[{"user": "admin", "password": ADMIN_PASSWORD}])
    server = EmbeddedNats(config=config + f'log_file: "{d / "server.log"}"\n')
    server.start()
    yield server, seeds, d / "server.log"
    server.stop()


def url_for(server: EmbeddedNats, user: str, password: str) -> str:
    return f"nats://{user}:{password}@{server.host}:{server.port}"


def violations(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "Violation" in line]


@pytest.mark.parametrize("transport", ["nats", "nixl"])
async def test_mesh_serves_with_least_privilege_users(secured, tiny_model, transport):
    """The KV crosses over ``transport`` (nixl: the two workers act as two hosts, and its
    handshake subjects must be in the roles' permissions)."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    server, seeds, log = secured
    cluster = Cluster(server.url)
    admin = url_for(server, "admin", ADMIN_PASSWORD)
    flags = ["--model", str(tiny_model), "--device-kv-blocks", "256", "--transports", f"{transport},nats"]
    dec, pre = f"dec-sec-{transport}", f"pre-sec-{transport}"
    try:
        cluster.worker("decode", *flags, "--nats-nkey", str(seeds["decode"]), "--worker-id", dec,
                       "--disagg-threshold", "16", env={"MESH_HOST_ID": f"host-{dec}"})
        cluster.worker("prefill", *flags, "--nats-nkey", str(seeds["prefill"]), "--worker-id", pre,
                       env={"MESH_HOST_ID": f"host-{pre}"})
        cluster.spawn("planner", "--nats", server.url, "--nats-nkey", str(seeds["planner"]), "--planner-window", "1")
        port = free_port()
        cluster.spawn("gateway", "--nats", url_for(server, "gateway", GATEWAY_PASSWORD), "--model",
                      str(tiny_model), "--host", "127.0.0.1", "--port", str(port))
        base = f"http://127.0.0.1:{port}"
        w = await Watcher.open(admin)
        try:
            await w.wait_for(lambda: w.membership.get(dec) and w.membership.get(pre), 120, "workers")
            await asyncio.to_thread(wait_http_ok, f"{base}/health", 60)
            await w.fresh_load(pre)
            await asyncio.sleep(1.2)  # the decode worker has heard the prefill worker's load
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            long_prompt = list(range(10, 60))  # past the disaggregation threshold: prefilled remotely
            for prompt in (long_prompt, [5, 6, 7]):
                out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
                assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
            assert [c async for c in stream][-1].choices[0].finish_reason == "length"
            # the Responses API: the gateway creates, writes, reads and purges its stored responses' bucket
            made = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
            assert (await client.responses.retrieve(made.id)).output_text == made.output_text
            await client.responses.delete(made.id)
            if transport == "nats":  # the Batch API: the files' object store and the batches' bucket
                await run_a_small_batch(client)
            counters = (await w.fresh_load(dec)).counters
            assert counters.get("remote_prefill_done", 0) >= 1, counters
            assert counters.get(f"transport_{transport}", 0) >= 1, counters
        finally:
            await w.close()
        assert not violations(log), violations(log)
    finally:
        cluster.stop()


async def run_a_small_batch(client: openai.AsyncOpenAI) -> None:
    """Two lines through /v1/files and /v1/batches; both answered in the output file."""
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}}) for i in range(2)]
    upload = await client.files.create(file=("lines.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        batch = await client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = (await client.files.content(batch.output_file_id)).text
    assert sorted(json.loads(line)["custom_id"] for line in out.splitlines()) == ["line-0", "line-1"]


async def test_worker_credentials_cannot_act_as_a_gateway(secured):
    server, seeds, log = secured
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    admin = await nats.connect(url_for(server, "admin", ADMIN_PASSWORD))
    seen = []

    async def on_msg(msg) -> None:
        seen.append(msg)

    generate = f"mesh.{MODEL}.decode.dec-sec.generate"
    await admin.subscribe(generate, cb=on_msg)
    await admin.flush()
    worker = await nats.connect(server.url, nkeys_seed=str(seeds["decode"]), error_cb=on_error,
                                inbox_prefix="_INBOX.decode")
    try:
        req = GenerateRequest("forged", MODEL, [1, 2, 3], SamplingOptions(max_tokens=2))
        await worker.publish(generate, encode(req), reply="_INBOX.decode.x")
        await worker.subscribe("_INBOX.gateway.>")  # a gateway's replies: token streams
        await worker.flush()
        deadline = time.monotonic() + 5
        while len(errors) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        text = " | ".join(str(e) for e in errors).lower()
        assert f'permissions violation for publish to "{generate}"' in text, text
        assert 'permissions violation for subscription to "_inbox.gateway.>"' in text, text
        await asyncio.sleep(0.3)
        assert seen == []  # nothing reached the subject
        logged = violations(log)  # and the server says who tried what
        assert any("Publish Violation" in v and generate in v for v in logged), logged
    finally:
        await worker.close()
        await admin.close()


async def test_prefill_credentials_cannot_write_a_gateways_token_streams(secured):
    """Only decode workers write token chunks to a gateway's inboxes; a prefill worker may answer
    a LoRA broadcast (``_INBOX.gateway.lora.*``) and nothing else there."""
    server, seeds, _ = secured
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    admin = await nats.connect(url_for(server, "admin", ADMIN_PASSWORD))
    seen = []

    async def on_msg(msg) -> None:
        seen.append(msg.subject)

    stream, lora = "_INBOX.gateway.abc123.r1", lora_reply_inbox("_INBOX.gateway.abc123")
    await admin.subscribe("_INBOX.gateway.>", cb=on_msg)
    await admin.flush()
    prefill = await nats.connect(server.url, nkeys_seed=str(seeds["prefill"]), error_cb=on_error,
                                 inbox_prefix="_INBOX.prefill")
    try:
        chunk = TokenChunk("victim", 0, [1, 2], worker="dec-sec")
        await prefill.publish(stream, encode(chunk))
        await prefill.publish(lora, b"reply")
        await prefill.flush()
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        text = " | ".join(str(e) for e in errors).lower()
        assert f'permissions violation for publish to "{stream.lower()}"' in text, text
        assert seen == [lora]  # the token stream got nothing; the LoRA reply went through
    finally:
        await prefill.close()
        await admin.close()


# -- operator mode: a creds file (user JWT + nkey seed) whose JWT carries the role's permissions ------


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _keypair(prefix: int):
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    kp = nkeys.from_seed(bytearray(seed))
    return seed.decode(), kp.public_key.decode(), kp


def _jwt(issuer, claims: dict) -> str:
    """A NATS JWT (what nsc writes): ed25519-nkey signature over header.payload."""
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {"iat": int(time.time()), "jti": secrets.token_hex(16).upper(), **claims}
    payload = _b64(json.dumps(claims).encode())
    return f"{header}.{payload}.{_b64(issuer.sign(f'{header}.{payload}'.encode()))}"


def _creds(user_jwt: str, seed: str) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")


@pytest.fixture(scope="module")
def operator_mode(tmp_path_factory):
    d = tmp_path_factory.mktemp("operator")
    _, op, op_kp = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _, acct, acct_kp = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, sys_acct, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
                 "leaf": -1}
    operator = _jwt(op_kp, {"iss": op, "sub": op, "name": "op", "nats": {"type": "operator", "version": 2,
                                                                        "system_account": sys_acct}})
    mesh_acct = _jwt(op_kp, {"iss": op, "sub": acct, "name": "mesh", "nats": {"type": "account", "version": 2, "limits": {
        **unlimited, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}}})
    system = _jwt(op_kp, {"iss": op, "sub": sys_acct, "name": "SYS",
                          "nats": {"type": "account", "version": 2, "limits": unlimited}})
    creds = {}
    for name, perms in (("decode", permissions("decode", "mesh", ["mock"]).to_jwt()), ("admin", {})):
        seed, user, _ = _keypair(nkeys.PREFIX_BYTE_USER)
        claims = {"iss": acct, "sub": user, "name": name, "nats": {
            **perms, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}}
        creds[name] = d / f"{name}.creds"
        creds[name].write_text(_creds(_jwt(acct_kp, claims), seed))
    config = (f"operator: {operator}\nsystem_account: {sys_acct}\nresolver: MEMORY\n"
              f"resolver_preload: {{\n  {acct}: {mesh_acct}\n  {sys_acct}: {system}\n}}\n")
    with EmbeddedNats(config=config) as server:
        yield server, creds


async def test_a_creds_file_with_the_roles_permissions(operator_mode):
    server, creds = operator_mode
    cluster = Cluster(server.url)
    try:
        cluster.worker("mock", "--nats-creds", str(creds["decode"]), "--worker-id", "dec-creds", "--metrics-port", "-1")
        bus = await Bus.connect(server.url, "admin", config=NatsConfig.build(server.url, creds=str(creds["admin"])))
        membership = Membership(bus)
        await membership.start(wait=1.0)
        deadline = time.monotonic() + 60
        while membership.get("dec-creds") is None:  # it joined, opened the registry and put its card
            assert time.monotonic() < deadline, "the worker never registered"
            await asyncio.sleep(0.2)
        await membership.stop()
        await bus.close()
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e).lower())

        nc = await nats.connect(server.url, user_credentials=str(creds["decode"]), error_cb=on_error)
        await nc.publish("mesh.mock.decode.dec-creds.generate", b"forged")
        await nc.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.05)
        await nc.close()
        assert any('permissions violation for publish to "mesh.mock.decode.dec-creds.generate"' in e
                   for e in errors), errors
    finally:
        cluster.stop()
