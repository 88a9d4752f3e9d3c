"""examples/custom_worker.py as a user runs it: a process that joins a running mesh (a real
nats-server and a real ``mesh gateway``), shows up in /v1/models, serves completions through
the official ``openai`` client, and leaves the registry when it stops.

The example is a rule-based model: "<a> <op> <b>" in the prompt -> the result, anything
else -> the prompt in upper case; every reply ends with the end-of-sequence token.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from mesh.tokenizer import Tokenizer
from tests.helpers.cluster import Watcher, wait_http_ok

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_worker.py"
SERVED = "echo"
WORKER_ID = "rules-0"


@pytest.fixture(scope="module")
def mesh(cluster, tiny_model):
    worker = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--nats", cluster.nats_url, "--tokenizer", str(tiny_model),
         "--served-name", SERVED, "--worker-id", WORKER_ID],
        stdout=subprocess.DEVNULL, stderr=None,
    )
    cluster.procs.append(worker)
    # the gateway knows the tokenizer (and chat template) of the name the worker serves
    url = cluster.gateway(tiny_model, None, "--served-name", SERVED)
    wait_http_ok(url + "/health", 90)  # 200 once a decode worker for a model is live
    return url, worker


@pytest.fixture
def client(mesh):
    return openai.OpenAI(base_url=mesh[0] + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def reply_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False)) + 1  # + the end-of-sequence token


def test_the_custom_worker_is_listed(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].owned_by == "pdmesh"


def test_completion_follows_the_rules(client, tok):
    r = client.completions.create(model=SERVED, prompt="What is 19 + 23?", max_tokens=16)
    (choice,) = r.choices
    assert choice.text == "42" and choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode("What is 19 + 23?"))
    assert r.usage.completion_tokens == reply_tokens(tok, "42")

    r = client.completions.create(model=SERVED, prompt="Hello, mesh", max_tokens=16)
    assert r.choices[0].text == "HELLO, MESH" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == reply_tokens(tok, "HELLO, MESH")


def test_max_tokens_cuts_the_reply(client, tok):
    r = client.completions.create(model=SERVED, prompt="Hello, mesh", max_tokens=2)
    ids = tok.encode("HELLO, MESH", add_special_tokens=False)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    assert r.choices[0].text == tok.decode(ids[:2])


def test_chat_and_streaming(client):
    r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "what is 6 * 7"}])
    assert r.choices[0].message.content == "42" and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=SERVED, prompt="stream me", max_tokens=32, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "STREAM ME"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_card_and_leaving_the_mesh(mesh, cluster):
    url, worker = mesh
    w = await Watcher.open(cluster.nats_url)
    try:
        card = await w.wait_for(lambda: w.membership.get(WORKER_ID), 10, "the worker's card")
        assert (card.role, card.model, card.engine) == ("decode", SERVED, "rules")
        assert card.transports == {}  # no KV bytes to move: it never asks the prefill pool
        report = await w.fresh_load(WORKER_ID)
        assert report.counters["finished"] >= 4 and report.counters["errors"] == 0
        worker.send_signal(signal.SIGTERM)  # drain, deregister, exit
        assert worker.wait(30) == 0
        await w.wait_for(lambda: w.membership.get(WORKER_ID) is None, 10, "the card to go")
    finally:
        await w.close()
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        deadline = time.monotonic() + 10
        while (await http.get("/v1/models")).json()["data"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (await http.get("/v1/models")).json()["data"] == []
