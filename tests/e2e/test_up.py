"""``mesh up`` as a user runs it: it starts, answers, and leaves nothing behind."""

from __future__ import annotations

import json
import signal
import stat
import time
from pathlib import Path

import httpx
import jsonschema
import openai

from tests.helpers.cluster import start_up
from tests.helpers.procs import alive, descendants

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"], "additionalProperties": False}


def test_mesh_up_answers_and_stops_cleanly_on_ctrl_c(tmp_path):
    """SIGINT here; SIGTERM in the mocker's test below (``mesh up`` handles both alike, and stops
    its children the same way whichever came)."""
    # the default model is generated into the cache directory on first use
    proc, url = start_up(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        kids = descendants(proc.pid)
        assert len(kids) >= 4  # nats-server, gateway, prefill, decode
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello, mesh",
                                                       "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
        assert (tmp_path / "cache" / "pdmesh" / "models" / "tiny" / "model.safetensors").is_file()
        _the_default_model_calls_tools(url)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 0
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "children left running"


def _the_default_model_calls_tools(url: str) -> None:
    """The quickstart's tools request: the default model's template renders tools (Qwen2.5's, Hermes
    calls), so a required tool call comes back with arguments that match the function's schema."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}}],
        tool_choice="required", max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)


def test_mesh_up_mock_serves_the_mocker_and_stops_cleanly_on_sigterm(tmp_path):
    proc, url = start_up("--mock", "--decode", "2", "--prefill", "1", "--mock-speedup", "50")
    try:
        kids = descendants(proc.pid)
        assert len(kids) >= 4  # nats-server, gateway, prefill, decode
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["mock"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "mock", "prompt": list(range(1, 40)),
                                                       "max_tokens": 7}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 39, "completion_tokens": 7, "total_tokens": 46,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        # one generated block-hash secret (0600) for the gateway and every worker, by its path
        argvs = [Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0") for k in descendants(proc.pid)]
        keyed = [a for a in argvs if b"cli" in a and (b"gateway" in a or b"worker" in a)]
        assert len(keyed) >= 4  # the gateway, 2 decode and 1 prefill workers
        files = {a[a.index(b"--hash-key-file") + 1].decode() for a in keyed}
        (key_file,) = files
        assert stat.S_IMODE(Path(key_file).stat().st_mode) == 0o600
        assert len(bytes.fromhex(Path(key_file).read_text())) == 32
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0
    assert not Path(key_file).parent.exists()  # the run directory goes with mesh up
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "children left running"


def test_mesh_up_mock_with_a_model_speaks_its_language(tmp_path, tiny_model):
    """``--mock --model DIR``: the mocker serves under the directory's name, and the gateway renders
    chat with that model's template and tokenizer, so chat requests and text prompts work."""
    model = tmp_path / "chatty"
    model.symlink_to(tiny_model, target_is_directory=True)
    proc, url = start_up("--mock", "--model", str(model), "--decode", "1", "--prefill", "0", "--no-planner",
                         "--mock-speedup", "50")
    try:
        assert "the mocker as" in proc.up_line
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["chatty"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "chatty", "messages": [{"role": "user", "content": "Hello there, mocker"}], "max_tokens": 6})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "chatty" and body["usage"]["completion_tokens"] == 6
        assert isinstance(body["choices"][0]["message"]["content"], str)
        # the prompt went through the model's chat template: more tokens than the words alone
        from mesh.tokenizer import Tokenizer
        words = len(Tokenizer(str(tiny_model)).encode("Hello there, mocker", add_special_tokens=False))
        assert body["usage"]["prompt_tokens"] > words
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
