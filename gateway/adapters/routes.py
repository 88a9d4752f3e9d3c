"""Runtime LoRA adapters through the gateway: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` with vLLM's names and bodies (``lora_name``, ``lora_path``).

One request reaches every worker of the base model (decode and prefill) over the bus
(``mesh.adapters.broadcast``); the answer is 200 with vLLM's ``Success: ...`` text when all of
them did it, else the first failure in OpenAI's error shape. A success returns once this
gateway's registry view shows the change, so the next request naming the adapter routes.

Admin-only: both endpoints call ``app.state.require_admin(request)`` first. Without API keys
it lets everyone through (``open_admin``); with keys, ``asgi_app`` installs
``gateway.auth.require_admin`` there: a 403 unless the request's key has ``role=admin``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import APIError
from gateway.requests.bodies import parse_body
from mesh import metrics
from mesh.adapters import broadcast
from mesh.protocol import LoraReply, LoraRequest

AdminCheck = Callable[[Request], Awaitable[None]]
VIEW_WAIT = 5.0  # seconds a success waits for this gateway's registry view to show the change


async def open_admin(request: Request) -> None:
    """The admin check without API keys under ``--insecure-admin``: everyone may."""


async def closed_admin(request: Request) -> None:
    """The admin check without API keys (the default): nobody may. Loading an adapter makes every
    worker read a path of the caller's choosing, which no anonymous client should name."""
    metrics.GATEWAY_REJECTED.labels("admin_closed").inc()
    raise APIError(403, "the admin routes are closed: this gateway has no API keys; give it an admin key "
                        "(--admin-api-key, MESH_ADMIN_API_KEYS or role=admin in --api-key-file), or start it "
                        "with --insecure-admin to open them to every client", code="permission_denied")


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM clients may send lora_int_id and the like
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)
    model: str | None = None  # the base model; optional when the gateway serves one


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=128)
    model: str | None = None


def install_adapter_routes(app: FastAPI, gateway) -> None:
    # with API keys, ``asgi_app`` replaces this with ``gateway.auth.require_admin``
    app.state.require_admin = open_admin if gateway.config.insecure_admin else closed_admin

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        await request.app.state.require_admin(request)
        body = await _body(request, LoadLoraBody)
        if body.lora_name in gateway.live_models():
            raise APIError(400, f"{body.lora_name!r} is a served model's name", "lora_name")
        base = _base(gateway, body.model, body.lora_name)
        await _apply(gateway, base, LoraRequest("load", body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        await request.app.state.require_admin(request)
        body = await _body(request, UnloadLoraBody)
        base = body.model or gateway.adapters().get(body.lora_name)
        if base is None:
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "lora_name", "model_not_found")
        await _apply(gateway, _base(gateway, base, body.lora_name), LoraRequest("unload", body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _body(request: Request, model: type[BaseModel]):
    return (await parse_body(request, model, empty=b"{}"))[0]


def _base(gateway, model: str | None, name: str) -> str:
    """The base model the adapter goes on: ``model``, or the one model this mesh serves."""
    live = gateway.live_models()
    if model is None:
        if len(live) != 1:
            raise APIError(400, f"this mesh serves {len(live)} models ({', '.join(live) or 'none'}): name the base "
                                f"model of {name!r} in \"model\"", "model")
        return live[0]
    if model not in live:
        raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
    return model


async def _apply(gateway, base: str, req: LoraRequest) -> None:
    """Send ``req`` to every worker of ``base``; APIError unless all of them did it."""
    # embed workers (role embed) run no adapters and do not answer
    cards = [c for c in gateway.membership.cards(base) if c.status == "ready" and c.role != "embed"]
    replies = await broadcast(gateway.bus, base, req, expected=len(cards))
    failed = [r for r in replies if not r.ok]
    if failed:
        first = failed[0]
        status = first.status if first.status in (400, 404) else 502
        # every worker fails a broken directory the same way: say it once, not per worker
        raise APIError(status, first.error, "lora_path" if req.action == "load" and status == 400 else "lora_name")
    answered = {r.worker_id for r in replies}
    missing = [c.worker_id for c in cards if c.worker_id not in answered]
    if not replies:
        raise APIError(503, f"no worker of {base!r} answered the {req.action} of {req.name!r}")
    if missing:
        raise APIError(504, f"{len(missing)} of {len(cards)} workers of {base!r} did not answer the {req.action} "
                            f"of {req.name!r} in time ({', '.join(missing)})")
    await _until_seen(gateway, replies, req)


async def _until_seen(gateway, replies: list[LoraReply], req: LoraRequest) -> None:
    """Wait (bounded) until this gateway's cards of the workers that answered show the change."""
    want = req.action == "load"
    deadline = time.monotonic() + VIEW_WAIT
    while time.monotonic() < deadline:
        cards = [gateway.membership.get(r.worker_id) for r in replies]
        if all(c is None or (req.name in c.adapters) == want for c in cards):
            return
        await asyncio.sleep(0.02)
