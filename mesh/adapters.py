"""LoRA adapters across the mesh: a worker's side of runtime load/unload, and the sender's.

Every worker of a model subscribes to ``{ns}.{model}.lora``; an admin ``LoraRequest`` there
reaches them all, and ``broadcast`` gathers one ``LoraReply`` per worker for a short while.
A worker reads the adapter directory in a thread (the engine keeps stepping; the engine's
``LoraManager`` takes loads from any thread), then rewrites its card at once, so gateways list
the adapter and routers send its requests there within one registry update.

Who holds what: the engine's ``LoraManager`` holds every loaded adapter until unloaded;
requests already running on an unloaded adapter finish on it (the sequence holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack

from mesh.bus import Bus
from mesh.errors import LoraError
from mesh.natsperms import lora_reply_inbox
from mesh.protocol import DecodeError, LoraReply, LoraRequest, decode, encode

log = logging.getLogger(__name__)

GATHER_SECONDS = 10.0  # the longest a broadcast waits for the workers' replies (loading reads files)


def adapter_names(engine) -> list[str]:
    """The adapters an engine holds (none for engines without LoRA, like the mocker)."""
    lora = getattr(engine, "lora", None)
    return lora.names if lora is not None else []


def hot_adapters(engine) -> list[str]:
    """Adapters in the engine's device slots now (engine thread)."""
    lora = getattr(engine, "lora", None)
    if lora is None:
        return []
    return sorted(a.name for a in lora.slots.held if a is not None and lora.adapters.get(a.name) is a)


def lora_slots(engine) -> int:
    lora = getattr(engine, "lora", None)
    return lora.slots.size if lora is not None else 0


async def serve_lora_requests(worker, stack: AsyncExitStack) -> None:
    """Answer ``LoraRequest``s on the worker's model's ``lora`` subject."""
    engine = worker.engine

    async def on_request(req: LoraRequest, raw) -> None:
        reply = await _apply(worker, req)
        if raw.reply:
            with contextlib.suppress(Exception):
                await worker.bus.publish(raw.reply, reply, traced=False)

    sub = await worker.bus.subscribe(worker.bus.subjects.lora(engine.model_name), on_request, LoraRequest)

    async def unsubscribe() -> None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

    stack.push_async_callback(unsubscribe)


async def _apply(worker, req: LoraRequest) -> LoraReply:
    engine = worker.engine
    ok, error, status = True, "", 0
    try:
        if req.action == "load":
            if not req.path:
                raise LoraError("load needs the adapter's directory (path)")
            await asyncio.to_thread(engine.load_lora, req.name, req.path)
        elif req.action == "unload":
            if not engine.unload_lora(req.name):
                ok, error, status = False, f"LoRA adapter {req.name!r} is not loaded", 404
        else:
            ok, error, status = False, f"unknown action {req.action!r} (load or unload)", 400
    except LoraError as e:
        ok, error, status = False, str(e).splitlines()[0], 400
    except Exception as e:  # never leave the sender without an answer
        log.exception("LoRA %s of %s failed", req.action, req.name)
        ok, error, status = False, f"{type(e).__name__}: {e}", 500
    if ok:
        log.info("LoRA adapter %s %sed on %s", req.name, req.action, worker.worker_id)
        if worker.cards is not None:
            with contextlib.suppress(Exception):
                await worker.cards.put()
    return LoraReply(worker.worker_id, ok, error, status, adapter_names(engine))


async def broadcast(bus: Bus, model: str, req: LoraRequest, expected: int,
                    timeout: float = GATHER_SECONDS) -> list[LoraReply]:
    """Send ``req`` to every worker of ``model``; the replies that came within ``timeout``
    (returns as soon as ``expected`` have)."""
    inbox = lora_reply_inbox(bus.nc.new_inbox())  # where prefill workers may answer too
    replies: list[LoraReply] = []
    enough = asyncio.Event()

    async def on_reply(msg) -> None:
        try:
            replies.append(decode(msg.data, LoraReply))
        except DecodeError as e:
            log.warning("dropped a malformed LoRA reply: %s", e)
            return
        if len(replies) >= expected:
            enough.set()

    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    try:
        await bus.nc.publish(bus.subjects.lora(model), encode(req), reply=inbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), timeout)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return replies
