"""``/v1/embeddings`` through the official ``openai`` client against a real ``mesh up`` with an embed
pool beside the generate pool (``--embed-workers 1``): the vectors are transformers' (the default
``last`` pooling, normalised), in float and base64; many inputs in one request equal one request
each; bad requests are OpenAI's 400s and 404s; chat requests never reach the embed worker."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from mesh.tokenizer import Tokenizer
from tests.helpers.cluster import Watcher, start_up

KEY = "sk-embed-test"
TEXTS = ["Hello, mesh", "Embeddings are pooled hidden states.", "a", "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def mesh(tiny_model):
    proc, url = start_up("--model", str(tiny_model), "--embed-workers", "1", "--prefill", "0", "--no-planner",
                         "--api-key", KEY)
    try:
        assert "1 embed" in proc.up_line
        nats_url = re.search(r"NATS (nats://[\d.:]+)", proc.up_line).group(1)
        yield url, nats_url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"{mesh[0]}/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers' last-token hidden state, normalised, of each text as the gateway tokenizes it."""
    model = AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = Tokenizer(str(tiny_model))
    out = []
    with torch.no_grad():
        for text in TEXTS:
            hidden = model(torch.tensor([tok.encode(text)])).last_hidden_state[0]
            out.append(F.normalize(hidden[-1], dim=-1).numpy())
    return np.stack(out), sum(len(tok.encode(t)) for t in TEXTS)


def test_float_and_base64_vectors_are_transformers(client, reference):
    expected, tokens = reference
    default = client.embeddings.create(model="tiny", input=TEXTS, user="u-1")  # the client asks base64, decodes it
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    for response in (default, floats):
        assert response.model == "tiny" and [d.index for d in response.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(np.array([d.embedding for d in response.data]), expected, atol=1e-4, rtol=0)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    np.testing.assert_allclose(decoded, expected, atol=1e-4, rtol=0)


def test_many_inputs_in_one_request_equal_one_request_each(client):
    prompts = [list(range(3 + i, 3 + i + 1 + (7 * i) % 40)) for i in range(24)]
    together = client.embeddings.create(model="tiny", input=prompts, encoding_format="float")
    alone = [client.embeddings.create(model="tiny", input=p, encoding_format="float").data[0].embedding
             for p in prompts]
    np.testing.assert_allclose(np.array([d.embedding for d in together.data]), np.array(alone), atol=1e-5, rtol=0)
    assert together.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_bad_requests_are_openai_errors(client, mesh):
    with pytest.raises(openai.BadRequestError) as e:  # the tiny model declares no matryoshka sizes
        client.embeddings.create(model="tiny", input="hi", dimensions=16)
    assert e.value.body["param"] == "dimensions" and "matryoshka" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input=[1] * 16385)  # over the context
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="")
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="no-such-model", input="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hi", extra_headers={"x-priority": "soon"})
    assert e.value.body["param"] == "x-priority"
    batch_line = client.embeddings.create(model="tiny", input="hi", extra_headers={"x-priority": "batch"})
    assert len(batch_line.data[0].embedding) == 64  # what the Batch API sends: served, after interactive work
    r = httpx.post(f"{mesh[0]}/v1/embeddings", json={"model": "tiny", "input": "hi"}, timeout=10)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_requests_never_reach_the_embed_worker(client, mesh):
    async def main():
        watcher = await Watcher.open(mesh[1])
        try:
            (embed,) = await watcher.wait_workers("embed", 1, "tiny")
            (decode,) = await watcher.wait_workers("decode", 1, "tiny")
            before = await asyncio.gather(watcher.fresh_load(embed.worker_id), watcher.fresh_load(decode.worker_id))
            for _ in range(6):
                out = await asyncio.to_thread(client.chat.completions.create, model="tiny", max_tokens=2,
                                              messages=[{"role": "user", "content": "hello"}])
                assert out.choices[0].finish_reason == "length"
            after = await asyncio.gather(watcher.fresh_load(embed.worker_id), watcher.fresh_load(decode.worker_id))
            return before, after
        finally:
            await watcher.close()

    (embed_before, decode_before), (embed_after, decode_after) = asyncio.run(main())
    assert embed_after.role == "embed" and embed_after.requests_total == embed_before.requests_total
    assert decode_after.requests_total == decode_before.requests_total + 6
    models = httpx.get(f"{mesh[0]}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_a_batch_mixes_all_four_endpoints(client, reference):
    """The Batch API runs embeddings lines beside chat, completions and responses lines, each
    answered as its route answers it: the embeddings lines carry transformers' vectors."""
    expected, _ = reference
    bodies = {
        "/v1/chat/completions": lambda i: {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": f"hi {i}"}]},
        "/v1/completions": lambda i: {"model": "tiny", "prompt": f"count {i}", "max_tokens": 2},
        "/v1/responses": lambda i: {"model": "tiny", "input": f"reply {i}", "max_output_tokens": 2},
        "/v1/embeddings": lambda i: {"model": "tiny", "input": TEXTS[i % len(TEXTS)], "encoding_format": "float"},
    }
    urls = list(bodies)
    rows = [{"custom_id": f"mix-{i}", "method": "POST", "url": urls[i % 4], "body": bodies[urls[i % 4]](i)}
            for i in range(24)]
    upload = client.files.create(file=("mix.jsonl", "\n".join(json.dumps(r) for r in rows).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(rows), batch
    out = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.output_file_id).read().splitlines())}
    assert sorted(out) == sorted(r["custom_id"] for r in rows)
    objects = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
               "/v1/responses": "response", "/v1/embeddings": "list"}
    for i, row in enumerate(rows):
        body = out[row["custom_id"]]["response"]["body"]
        assert body["object"] == objects[row["url"]], body
        if row["url"] == "/v1/embeddings":
            np.testing.assert_allclose(body["data"][0]["embedding"], expected[i % len(TEXTS)], atol=1e-4)
