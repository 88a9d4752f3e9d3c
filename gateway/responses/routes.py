"""The Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

No second generation path: a Responses request becomes the chat request it means
(``gateway.responses.items``), the chat path serves it (template, output plan, admission,
routing, streaming: a ``ChatRunner`` from ``gateway.completions``, which gateway/app.py hands
over), and a ``ResponseFormat`` (``gateway.responses.stream``) writes what comes back as a
Response or its stream events.

    parse (400s) --> tenant --> previous_response_id: the stored history (404 if none for the
    tenant) --> chat request --> the chat path --> Response / events
    store: the finished response and its conversation go to the bucket (``conversations``) before
           the client sees it complete: whole, before the body is sent; streamed, before
           response.completed. Not stored: store false, a failed or abandoned response.

The routes sit behind the gateway's API keys like every other; the key in
``scope["state"]["api_key"]`` decides the tenant (the Batch API calls the route in-process the
same way).
"""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.errors import APIError
from gateway.formats import ChatRunner, Format
from gateway.requests.bodies import parse_json, read_body
from gateway.requests.schemas import ChatCompletionRequest, openapi_body
from gateway.responses.conversations import Conversations, not_found, tenant_of
from gateway.responses.items import chat_request, new_messages, output_messages, renamed
from gateway.responses.schema import FunctionChoice, ResponsesRequest
from gateway.responses.stream import ResponseFormat
from gateway.service import Gateway, Target


def install_responses_routes(app: FastAPI, gateway: Gateway, run_chat: ChatRunner) -> None:
    store = Conversations(gateway, gateway.config.responses_ttl)

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def create_response(request: Request):
        try:
            turn, chat, size = await _turn(gateway, store, request)
        except APIError as e:  # refused before the chat path (which counts what it answers)
            gateway.stats.request("responses", e.status)
            raise
        try:
            response = await run_chat(request, chat, size, turn.format)
        except APIError as e:
            raise renamed(e) from None
        if not turn.body.stream and response.status_code == 200 and turn.fmt is not None:
            await turn.save(turn.fmt.response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request, stream: bool = False):
        if stream:
            raise APIError(400, "streaming a stored response again is not supported", "stream",
                           "unsupported_parameter")
        record = await store.get(_tenant(gateway, request), response_id)
        if record is None:
            raise not_found(response_id)
        return JSONResponse(record["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not await store.delete(_tenant(gateway, request), response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


async def _turn(gateway: Gateway, store: Conversations, request: Request) -> tuple[Turn, ChatCompletionRequest, int]:
    """The request's turn of its conversation, its chat request and what rendering it costs (bytes)."""
    raw = await read_body(request)
    body = parse_request(raw)
    tenant = _tenant(gateway, request)
    history: list[dict] = []
    if body.previous_response_id is not None:
        record = await store.get(tenant, body.previous_response_id)
        if record is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = record["history"]
    chat = chat_request(body, history)
    size = len(raw) + len(json.dumps(history, separators=(",", ":")))
    if body.store:
        store.check_room(size)
    return Turn(store, tenant, body, history), chat, size


def _tenant(gateway: Gateway, request: Request) -> str:
    return tenant_of(request.scope.get("state", {}).get("api_key"), gateway.config.router.hash_key.secret)


def parse_request(raw: bytes) -> ResponsesRequest:
    return parse_json(raw, ResponsesRequest)


class Turn:
    """One request's turn of its conversation: makes its ``ResponseFormat`` and stores the result."""

    def __init__(self, store: Conversations, tenant: str, body: ResponsesRequest, history: list[dict]):
        self.store, self.tenant, self.body, self.history = store, tenant, body, history
        self.rid = f"resp_{uuid.uuid4().hex}"
        self.fmt: ResponseFormat | None = None

    def format(self, gw: Gateway, chat: ChatCompletionRequest, target: Target, prompt: list[int]) -> Format:
        self.fmt = ResponseFormat(self.rid, prompt, echo(self.body), self.save if self.body.store else None)
        return self.fmt

    async def save(self, response: dict) -> None:
        if not self.body.store:
            return
        history = [*self.history, *new_messages(self.body), *output_messages(response["output"])]
        await self.store.put(self.tenant, self.rid, {"response": response, "history": history})


def echo(body: ResponsesRequest) -> dict:
    """The request's fields a Response repeats."""
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "name": choice.name}
    fmt = body.text_format
    text_format = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
    return {
        "model": body.model, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": choice or ("auto" if body.tools else "none"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": text_format}, "reasoning": {"effort": None, "summary": None},
        "store": body.store, "truncation": "disabled", "metadata": body.metadata or {},
        "user": body.user, "background": False, "service_tier": "default",
    }
