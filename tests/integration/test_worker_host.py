"""Many simulated workers in one process (``mesh worker mock --num-workers N``): each a whole worker
on the bus, behind a real gateway on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import openai

from mesh.protocol import KvEventBatches, RouterDecision, decode
from mocker.spec import next_token
from tests.helpers.cluster import Watcher, wait_http_ok
from tests.helpers.procs import tcp_peers

NS = "host"
N = 24


async def test_many_workers_in_one_process_go_live_and_serve(cluster, tiny_model):
    proc = cluster.worker("mock", "--ns", NS, "--model", str(tiny_model), "--num-workers", str(N),
                          "--worker-id", "hostA", "--device-kv-blocks", "256", "--mock-speedup", "10")
    url = cluster.gateway(tiny_model, None, "--ns", NS)
    w = await Watcher.open(cluster.nats_url, ns=NS)
    try:
        cards = await w.wait_workers("decode", N, timeout=60)
        # each its own worker: its own id and card, all in the one process
        assert sorted(c.worker_id for c in cards) == [f"hostA-{i:04d}" for i in range(N)]
        assert {c.pid for c in cards} == {proc.pid} and {c.engine for c in cards} == {"mock"}
        await w.wait_for(lambda: len(w.loads) >= N, 10, "a load report from every worker")
        # ...sent together, one message a tick for the process (mesh.loads), none alone, and their
        # cards refreshed together under the process's one set key (mesh.cardset)
        kinds: list[str] = []

        async def on_raw(msg) -> None:
            kinds.append(msg.subject.split(".")[2])

        async def on_put(msg) -> None:
            kinds.append(msg.subject.split(".", 2)[2])

        sub = await w.bus.nc.subscribe(f"{NS}.*.load.*", cb=on_raw)
        subs = await w.bus.nc.subscribe(f"{NS}.*.loads.*", cb=on_raw)
        puts = await w.bus.nc.subscribe(f"$KV.{w.bus.subjects.workers_bucket()}.>", cb=on_put)
        await asyncio.sleep(2.2)  # two load ticks at least, and a card refresh
        for s in (sub, subs, puts):
            await s.unsubscribe()
        loads = [k for k in kinds if k == "loads"]
        assert loads and set(kinds) - {"loads"} == {"decode.set.hostA-0"} and len(loads) < N, kinds
        await asyncio.to_thread(wait_http_ok, url + "/health")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def ask(i: int) -> int:
            r = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"question {i} " * (1 + i % 7)}],
                max_tokens=8, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        events: list[tuple[str, int]] = []  # (subject kind, batches in the message)

        async def on_events(msg) -> None:
            kind = msg.subject.split(".")[3]
            events.append((kind, len(decode(msg.data, KvEventBatches).batches) if kind == "batches" else 1))

        kv_subs = [await w.bus.nc.subscribe(f"{NS}.*.kv.{kind}.*", cb=on_events) for kind in ("events", "batches")]
        assert await asyncio.gather(*(ask(i) for i in range(3 * N))) == [8] * (3 * N)
        # the gateway's router spread them over the process's workers, each answering for itself
        served = await w.wait_for(
            lambda: (s := [wid for wid, r in w.loads.items() if r.counters.get("finished", 0)]) and len(s) >= 4 and s,
            10, "load reports of the workers that served")
        assert set(served) <= {c.worker_id for c in cards}
        # their KV events came as the process's messages (mesh.kvevents.KvBatcher), and the router took
        # every batch in them
        for sub in kv_subs:
            await sub.unsubscribe()
        assert events and {k for k, _ in events} == {"batches"}, events
        # their batches reached the gateway over one token link for the whole process (mesh.tokenlink)
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(url + "/metrics")).text
        linked = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pdmesh_gateway_token_links "))
        indexed = next(float(x.split()[-1]) for x in metrics.splitlines()
                       if x.startswith('pdmesh_router_kv_events_total{unit="batches"}'))
        assert indexed >= sum(n for _, n in events)
        nats_port = int(cluster.nats_url.rsplit(":", 1)[1])
        assert linked >= len(served) and len([p for p in tcp_peers(proc.pid) if p[1] != nats_port]) == 1
    finally:
        await w.close()
        proc.terminate()


KILL_NS = "hostkill"
STEP_MS = 40  # a stream of 60 tokens runs ~2.4 s: many are mid-stream when their process dies


def expected(prompt: list[int], n: int, vocab: int) -> list[int]:
    out, last = [], prompt[-1]
    for i in range(n):
        last = next_token(last, len(prompt) + i, vocab)
        out.append(last)
    return out


async def test_a_process_of_workers_killed_mid_load_leaves_routing_and_its_streams_finish_elsewhere(
        cluster, tiny_model):
    """A host's worth of workers dies at once (SIGKILL of their process): within 6 s no decision
    names them; every stream, those they served included, finishes with exactly the tokens it would
    have had (the mocker's are a function of the prompt: a resumed stream continues them); any
    error a client sees says what happened."""
    timing = [a for t in (f"decode_base_ms={STEP_MS}", "decode_ms_per_seq=0", "decode_ms_per_kv_token=0")
              for a in ("--mock-timing", t)]
    hosts = {h: cluster.worker("mock", "--ns", KILL_NS, "--model", str(tiny_model), "--num-workers", "8",
                               "--worker-id", h, "--device-kv-blocks", "512", *timing) for h in ("hostK", "hostL")}
    url = cluster.gateway(tiny_model, None, "--ns", KILL_NS)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    w = await Watcher.open(cluster.nats_url, ns=KILL_NS)
    decisions: list[tuple[float, str]] = []

    async def on_decision(d: RouterDecision, raw) -> None:
        decisions.append((time.monotonic(), d.worker_id))

    await w.bus.subscribe(w.bus.subjects.router_decisions(), on_decision, RouterDecision)
    try:
        await w.wait_workers("decode", 16, timeout=60)
        await w.wait_for(lambda: len(w.loads) >= 16, 10, "load reports")
        await asyncio.to_thread(wait_http_ok, url + "/health")
        rng = random.Random(4)
        results: list[tuple[list[int], list[int]]] = []  # (prompt, tokens got)
        errors: list[str] = []
        stop_at = [time.monotonic() + 60]

        async def client(http: httpx.AsyncClient) -> None:
            while time.monotonic() < stop_at[0]:
                prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(20, 60))]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                        "stream": True, "return_token_ids": True}
                got: list[int] = []
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(json.loads(await r.aread())["error"]["message"])
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event["error"]["message"])
                            break
                        got += event["choices"][0].get("token_ids") or []
                    else:
                        results.append((prompt, got))

        async with httpx.AsyncClient(timeout=60) as http:
            clients = [asyncio.create_task(client(http)) for _ in range(24)]
            await asyncio.sleep(2.0)  # streams everywhere
            await w.wait_for(  # one of hostK's is well under way (60 tokens take ~2.4 s)
                lambda: any(wid.startswith("hostK-") and 0.4 < time.monotonic() - t < 1.2 for t, wid in decisions),
                30, "a stream on hostK")
            killed_at = time.monotonic()
            hosts["hostK"].send_signal(signal.SIGKILL)  # the process: its 8 workers with it
            stop_at[0] = killed_at + 10.0  # new requests keep coming for 10 s after the kill
            await asyncio.wait_for(asyncio.gather(*clients), 90)
        late = [t - killed_at for t, wid in decisions if wid.startswith("hostK-") and t > killed_at]
        assert not late or max(late) <= 6.0, f"decisions named a dead worker {max(late):.1f} s after the kill"
        assert any(t > killed_at + 6.0 for t, _ in decisions)  # routing went on, to the living
        assert len(results) >= 24
        for prompt, got in results:
            assert got == expected(prompt, 60, vocab)  # resumed streams too: the same tokens
        assert all(e for e in errors), errors  # a clear message each, if any (none expected)
        assert len(errors) <= len(results) // 10, errors
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(url + "/metrics")).text
        moved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("pdmesh_gateway_migrations_total"))
        assert moved >= 1  # streams the dead workers served were resumed, not lost
        print(f"late decisions {max(late, default=0):.1f} s, resumed {moved:.0f}, {len(results)} streams, "
              f"errors {errors}")
    finally:
        await w.close()
        for p in hosts.values():
            if p.poll() is None:
                p.terminate()
