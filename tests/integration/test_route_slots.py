"""The router counts a worker's sequence slots by the requests it sent there that have not ended
(``mesh.router.table``): the gateway must end every one it routed, a request whose send failed
included, or that worker keeps a slot that is taken by nobody and is passed over
once its count reaches its limit. A real nats-server; the send fails because the bus is closed."""

from __future__ import annotations

import pytest

from gateway.choices.choice import ChoiceRun
from gateway.choices.replies import ReplyStreams
from gateway.service import TRACER, Gateway, GatewayConfig
from mesh.bus import Bus
from mesh.natsserver import EmbeddedNats
from mesh.protocol import SamplingOptions
from mesh.router.policy import RouterConfig
from mesh.router.router import KvRouter
from tests.unit.test_router_table import Cards, card


@pytest.fixture
def nats_url():
    with EmbeddedNats() as server:
        yield server.url


async def test_a_request_whose_send_fails_gives_its_slot_back(nats_url):
    gw = Gateway(GatewayConfig(nats_url=nats_url))
    gw.bus = await Bus.connect(nats_url, "gateway")
    gw.replies = ReplyStreams(gw.bus)
    gw.router = KvRouter(None, Cards([card("a", capacity=1), card("b", capacity=1)]), RouterConfig())
    gw.router._spawn = lambda coro: coro.close()
    prompt = list(range(40))

    async def send(rid):
        run = ChoiceRun(gw.retry_policy)
        return run, await gw._send(run, rid, "m", prompt, SamplingOptions(), 0, TRACER.start_span("t"))

    run, stream = await send("sent")  # routed and sent: it holds its worker's one slot until it ends
    assert gw.router.open == {run.worker_id: {"sent"}}
    gw._close(stream, "sent")
    await gw.bus.nc.close()
    with pytest.raises(Exception, match=r"(?i)closed"):
        await send("failed")  # routed, then its send failed: it never reached a worker
    assert gw.router.decisions == 2 and not any(gw.router.open.values())  # both slots free
    assert gw.replies._streams == {}
