"""The embed pool without NATS: which worker takes a part (mesh/router/embed.py), how a request's
inputs are cut to fit the bus (gateway/embeddings.py ``split_inputs``), what a body may hold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.embeddings import ENVELOPE_BYTES, EmbeddingRequest, split_inputs
from mesh.protocol import EmbedReply, EmbedRequest, WorkerCard, encode
from mesh.router.embed import EmbedRouter, pick_embed_worker


def card(wid: str, role: str = "embed", status: str = "ready") -> WorkerCard:
    return WorkerCard(wid, role, "m", 0, 0, 512, "h", 1, 0.0, 0.0, status=status, embed_dim=64)


class FakeMembership:
    def __init__(self, cards):
        self._cards = cards

    def cards(self, model=None, role=None):
        return [c for c in self._cards if (model is None or c.model == model) and (role is None or c.role == role)]


def test_the_least_busy_worker_wins_and_ties_take_turns():
    cards = [card("a"), card("b"), card("c")]
    assert pick_embed_worker(cards, {"a": 2, "b": 1, "c": 1}, 0).worker_id == "b"
    assert pick_embed_worker(cards, {"a": 2, "b": 1, "c": 1}, 1).worker_id == "c"
    assert [pick_embed_worker(cards, {}, t).worker_id for t in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(LookupError):
        pick_embed_worker([], {}, 0)


def test_the_router_keeps_to_ready_embed_workers_and_passes_over_the_silent():
    router = EmbedRouter(FakeMembership([card("e1"), card("e2"), card("d1", role="decode"),
                                         card("e3", status="draining")]))
    assert {c.worker_id for c in router.workers("m")} == {"e1", "e2"}  # never a decode worker
    router.started("e1")
    assert router.pick("m").worker_id == "e2"
    router.finished("e1")
    router.suspect("e2")
    assert {router.pick("m").worker_id for _ in range(4)} == {"e1"}
    assert router.pick("m", exclude={"e1"}).worker_id == "e2"  # the only one left, suspect or not
    with pytest.raises(LookupError):
        router.pick("m", exclude={"e1", "e2"})
    assert router.workers("other") == []


@pytest.mark.parametrize("dim", [64, 4096])
def test_parts_fit_the_bus_both_ways_and_keep_the_order(dim):
    max_payload = 64 << 10
    prompts = [list(range(1, 1 + n)) for n in (1, 300, 2000, 7, 5000, 64, 3) * 6]
    parts = split_inputs(prompts, dim, max_payload)
    assert [p for part in parts for p in part] == prompts
    for part in parts:
        request = encode(EmbedRequest("embd-" + "0" * 32, "m", part, 0))
        reply = encode(EmbedReply("embd-" + "0" * 32, "w" * 40, dim, b"\0" * (4 * dim * len(part))))
        assert len(request) <= max_payload - ENVELOPE_BYTES // 2 and len(reply) <= max_payload
    assert len(split_inputs([list(range(40000))], dim, max_payload)) == 1  # too big for any part: alone


def test_a_body_holds_one_input_or_a_list_none_empty():
    assert EmbeddingRequest(model="m", input="hi").inputs() == ["hi"]
    assert EmbeddingRequest(model="m", input=[1, 2, 3]).inputs() == [[1, 2, 3]]
    assert EmbeddingRequest(model="m", input=[[1], [2, 3]]).inputs() == [[1], [2, 3]]
    assert EmbeddingRequest(model="m", input=["a", "b"], encoding_format="base64", user="u").inputs() == ["a", "b"]
    for bad in ({"input": ""}, {"input": []}, {"input": ["a", ""]}, {"input": [[1], []]}, {"input": [-1]},
                {"input": "a", "encoding_format": "int8"}, {"input": "a", "dimensions": 0},
                {"input": ["a"] * 2049}):
        with pytest.raises(ValidationError):
            EmbeddingRequest(model="m", **bad)
