"""What the peer-fetch tests share (one host, two simulated ones, the host bed): the decode
workers' flags, one request as the gateway sends it, the plan the gateway puts in it, and a
prefix pushed into one worker's host tier where the router sees it."""

from __future__ import annotations

import random
import uuid

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.client import generate
from mesh.protocol import GenerateRequest, PeerFetchPlan, SamplingOptions

BS, PREFIX_BLOCKS = 16, 10


def decode_flags(model_dir, timeout: float = 3.0) -> list[str]:
    """A decode worker with a 24-block device pool (three other prompts push a prefix out of it)
    and a 64-block host tier that keeps it, serving and asking peer fetches."""
    return ["--model", str(model_dir), "--device-kv-blocks", "24", "--host-kv-blocks", "64", "--peer-fetch",
            "--peer-fetch-timeout", str(timeout), "--max-num-seqs", "4"]


def prompt_of(rng: random.Random) -> list[int]:
    """A prompt of ``PREFIX_BLOCKS`` whole blocks and one token more."""
    return [rng.randrange(3, 4000) for _ in range(PREFIX_BLOCKS * BS + 1)]


def prefix_hashes(prompt: list[int], model: str = "tiny", key=DEFAULT_HASH_KEY) -> list[int]:
    return block_hashes(prompt[: PREFIX_BLOCKS * BS], BS, hash_seed(key, model))


async def ask(bus, worker: str, tokens: list[int], router=None, plan: PeerFetchPlan | None = None,
              request_id: str | None = None, model: str = "tiny") -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request on ``worker``, as the gateway sends it
    (and, with ``router``, tells it the request finished)."""
    rid = request_id or uuid.uuid4().hex
    req = GenerateRequest(rid, model, tokens, SamplingOptions(max_tokens=6, temperature=0.0), peer_fetch=plan)
    toks, last = [], None
    async for chunk in generate(bus, worker, req, first_timeout=60, idle_timeout=30):
        assert chunk.error is None, chunk.error
        toks += chunk.token_ids
        last = chunk
    if router is not None:
        router.finished(worker, rid)
    return toks, last.usage.cached_tokens


def plan_of(d) -> PeerFetchPlan | None:
    """What the gateway puts in the request (gateway/service.py ``_send``)."""
    return PeerFetchPlan(d.fetch_source, d.fetch_blocks, d.hit_blocks) if d.fetch_source else None


async def prefix_in_host_tier(w, router, worker: str, rng: random.Random, timeout: float = 20.0,
                              model: str = "tiny", key=DEFAULT_HASH_KEY) -> tuple[list[int], list[int]]:
    """(prompt, its cold run's tokens): run cold on ``worker``, then three other prompts push its
    prefix out of the device pool into the host tier, until the router sees it only there
    (``model``'s blocks, hashed under ``key``: the mesh's)."""
    prompt = prompt_of(rng)
    cold, cached = await ask(w.bus, worker, prompt, model=model)
    assert cached == 0
    for _ in range(3):
        await ask(w.bus, worker, prompt_of(rng), model=model)
    idx, hashes = router.index(model), prefix_hashes(prompt, model, key)
    await w.wait_for(lambda: all(idx.tiers_of(worker, h) == {"host"} for h in hashes), timeout,
                     f"the prefix to sit only in {worker}'s host tier")
    return prompt, cold
