"""The embed pool without NATS: which worker takes a part (mesh/router/embed.py), how a request's
inputs are cut to fit the bus (gateway/embeddings/routes.py ``split_inputs``), what a body may hold."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from gateway.embeddings.routes import ENVELOPE_BYTES, EmbeddingRequest, Embeddings, split_inputs
from gateway.errors import APIError
from gateway.service import Gateway, GatewayConfig
from mesh.protocol import EmbedReply, EmbedRequest, WorkerCard, encode
from mesh.router.embed import EmbedRouter, pick_embed_worker


def card(wid: str, role: str = "embed", status: str = "ready") -> WorkerCard:
    return WorkerCard(wid, role, "m", 0, 0, 512, "h", 1, 0.0, 0.0, status=status, embed_dim=64)


class FakeMembership:
    version = 0  # the cards never change during a test

    def __init__(self, cards):
        self._cards = cards

    def cards(self, model=None, role=None):
        return [c for c in self._cards if (model is None or c.model == model) and (role is None or c.role == role)]

    cards_of = cards

    def derived(self, key, build):
        return build()


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


class FakeGatewayMembership(FakeMembership):
    def served_recently(self, model: str) -> bool:
        return any(c.model == model for c in self._cards)


def gateway_with(cards) -> Gateway:
    gw = Gateway(GatewayConfig(nats_url="nats://unused"))
    gw.membership = FakeGatewayMembership(cards)
    return gw


def test_embeddings_go_to_embed_workers_only_and_chat_never_does():
    gen_only = gateway_with([card("d1", role="decode")])
    with pytest.raises(APIError) as e:  # served, but not for embeddings
        Embeddings(gen_only)._workers("m")
    assert e.value.status == 503 and "--task embed" in e.value.message
    with pytest.raises(APIError) as e:
        Embeddings(gen_only)._workers("nobody-serves-this")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    embed_only = gateway_with([card("e1"), card("e2", status="draining")])
    assert [c.worker_id for c in Embeddings(embed_only)._workers("m")] == ["e1"]
    with pytest.raises(APIError) as e:  # a chat or completion for it
        embed_only.resolve("m")
    assert e.value.status == 400 and "embeddings only" in e.value.message
    assert embed_only.served_models() == ["m"] and embed_only.live_models() == []
    assert embed_only.max_model_len("m") == 512


def test_mesh_up_plans_an_embed_pool_of_its_own():
    from cli import build_parser
    from cli.flags import CliError
    from cli.localmesh import UpPlan, worker_argv
    from cli.up import _embed_pool
    from cli.worker import role_of

    args = build_parser().parse_args(["up", "--task", "embed", "--pooling", "mean"])
    assert _embed_pool(args) == 1 and args.decode == args.prefill == 0  # embeddings only
    args = build_parser().parse_args(["up", "--embed-workers", "2"])
    assert _embed_pool(args) == 2 and args.decode == 1  # beside the generate pools
    assert _embed_pool(build_parser().parse_args(["up"])) == 0
    for bad in (["up", "--embed-workers", "1", "--mock"], ["up", "--task", "embed", "--embed-workers", "0"]):
        with pytest.raises(CliError):
            _embed_pool(build_parser().parse_args(bad))
    plan = UpPlan(models=["/m/tiny"], mock=False, prefill=0, decode=0, host="h", port=1, nats=None, ns=None,
                  embed=1, embed_flags=["--task", "embed", "--pooling", "mean"])
    argv = worker_argv(plan, "/m/tiny")["embed"]
    assert argv[argv.index("worker") + 1] == "decode" and argv[-4:] == ["--task", "embed", "--pooling", "mean"]
    with pytest.raises(CliError):  # an embed worker runs a model
        role_of(build_parser().parse_args(["worker", "decode", "--task", "embed", "--mock"]))


async def test_the_next_forward_takes_the_highest_priority_first():
    from decode.embed import EmbedBatcher, _Pending

    batcher = EmbedBatcher(embedder=None, max_tokens=4)
    loop = asyncio.get_running_loop()
    for name, priority in (("batch-1", -1), ("chat-1", 0), ("batch-2", -1), ("chat-2", 0)):
        batcher.queue.append(_Pending([[1, 2]], 0, loop.create_future(), priority))
        batcher.queue[-1].name = name
    assert [p.name for p in batcher._take()] == ["chat-1", "chat-2"]  # 4 tokens: two requests
    assert [p.name for p in batcher._take()] == ["batch-1", "batch-2"]  # then the batch lines, in order
