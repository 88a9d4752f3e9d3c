"""The gateway's caps on work a client can ask for, and its admin routes, on real processes.

A mocker decode worker serving the tiny model's name and two gateways (the official ``openai``
client against them): a stop sequence of 1,001 characters is a 400 naming ``stop`` (1,000 is
served); without API keys the LoRA admin routes are closed (403 in OpenAI's error shape) unless
the gateway runs with ``--insecure-admin``. A gateway in this process, on the same bus, shows a
chat body heavy with tool-call arguments rendered off its event loop.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from mesh.natsserver import free_port
from tests.helpers.cluster import Watcher, wait_http_ok


@pytest.fixture(scope="module")
def gateways(cluster, tiny_model):
    cluster.worker("mock", "--model", str(tiny_model), "--worker-id", "caps-mock", "--mock-speedup", "20")
    closed = cluster.gateway(tiny_model, free_port())
    insecure = cluster.gateway(tiny_model, free_port(), "--insecure-admin")
    for base in (closed, insecure):
        wait_http_ok(f"{base}/health", 90)
    return closed, insecure


async def _wait_worker(cluster) -> None:
    w = await Watcher.open(cluster.nats_url)
    try:
        await w.wait_workers("decode", 1, timeout=60)
    finally:
        await w.close()


async def test_a_stop_over_1000_characters_is_a_400_naming_stop(gateways, cluster):
    await _wait_worker(cluster)
    client = openai.AsyncOpenAI(base_url=f"{gateways[0]}/v1", api_key="none", max_retries=0)
    for stop in ("x" * 1001, ["a", "y" * 1001]):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, stop=stop)
        assert e.value.body["param"] == "stop" and "1000 characters" in e.value.body["message"], e.value.body
    done = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, stop=["z" * 1000] * 4)
    assert done.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, stop="w" * 1001)
    assert e.value.body["param"] == "stop"


async def test_admin_routes_are_closed_without_an_admin_key_unless_insecure_admin(gateways, tmp_path):
    closed, insecure = gateways
    load = {"lora_name": "nope", "lora_path": str(tmp_path / "missing")}
    async with httpx.AsyncClient(timeout=30) as http:
        for route, body in (("load", load), ("unload", {"lora_name": "nope"})):
            r = await http.post(f"{closed}/v1/{route}_lora_adapter", json=body)
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["code"] == "permission_denied" and "--insecure-admin" in error["message"]
        # opened: the request reaches the adapter logic (an unknown adapter, not a refusal)
        r = await http.post(f"{insecure}/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


async def test_a_chat_body_heavy_with_tool_call_arguments_is_rendered_off_the_event_loop(
        gateways, cluster, tiny_model, monkeypatch):
    """Rendering and tokenizing go to a thread by the body's size: tool-call arguments, tools and
    every message part count, not only the messages' text (here two words). The arguments (20 kB,
    ~5k tokens: the default template renders them) fit the tiny model's context."""
    from gateway.app import asgi_app
    from gateway.service import Gateway, GatewayConfig

    threaded = []
    to_thread = asyncio.to_thread

    async def recording(fn, *args, **kwargs):
        threaded.append(getattr(fn, "__name__", ""))
        return await to_thread(fn, *args, **kwargs)

    gw = Gateway(GatewayConfig(nats_url=cluster.nats_url, model_dirs=(str(tiny_model),)))
    await gw.start()
    try:
        for _ in range(100):
            if "tiny" in gw.live_models():
                break
            await asyncio.sleep(0.1)
        monkeypatch.setattr(asyncio, "to_thread", recording)
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": " the" * 5_000})}}
        heavy = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "go"}]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(gw)), base_url="http://gw",
                                     timeout=30) as http:
            for messages in ([{"role": "user", "content": "hi"}], heavy):
                r = await http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": messages})
                assert r.status_code == 200, r.text
                if messages is not heavy:
                    assert "_render" not in threaded  # a small body renders on the loop (a thread costs more)
        assert "_render" in threaded
    finally:
        await gw.stop()
