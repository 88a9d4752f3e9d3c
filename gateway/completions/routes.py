"""The OpenAI chat and text completions: ``POST /v1/chat/completions`` and ``/v1/completions``,
and the chat path they run through, which the Responses API runs through too (``chat_runner``;
gateway/app.py hands it over). Parsing, admission and response shapes; the work is in
``gateway.service``.

A request's life, and who releases what:

    parse + validate --> tokenize --> limits --> acquire (429) --> one stream_choice per choice
        not streaming: collect all choices, racing the client's disconnect
        streaming:     wait for every choice's first delta (errors before it are real HTTP
                       statuses), then SSE, racing the client's disconnect
    release: once, when the response is done or abandoned (``_Admission``)
    cancel on the worker: ``stream_choice``'s finally, when a choice ends before its last chunk
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import BaseModel

from gateway.completions.formats import ChatFormat, CompletionFormat
from gateway.errors import APIError
from gateway.formats import ChatRunner, Format, FormatFactory
from gateway.outputs.plan import OutputPlan, plan_chat, plan_completion
from gateway.requests.bodies import parse_body
from gateway.requests.schemas import ChatCompletionRequest, CompletionRequest, openapi_body
from gateway.service import Gateway, Target
from gateway.streaming import (
    SSEResponse,
    SSEWriter,
    close_all,
    collect_all,
    first_deltas,
    sse_events,
    unless_disconnected,
)
from gateway.tenancy import cache_scope, clamp_priority, header_priority
from mesh.constraints.spec import Constraint
from mesh.protocol import ConstraintSpec, SamplingOptions
from mesh.telemetry import tracer
from mesh.tokenizer import ChatTemplateError, Tokenizer
from mesh.tracing import context_from

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for "the client went away"; nobody reads it
LONG_INPUT_CHARS = 16_384  # tokenize longer inputs in a thread
TRACER = tracer("pdmesh.gateway")


def install_completion_routes(app: FastAPI, gateway: Gateway) -> None:
    """The two routes on ``app`` (``CompletionRoutes`` serves them ahead of it in production)."""

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat(request: Request):
        return await _counted(gateway, "chat", request, _chat(gateway, request))

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await _counted(gateway, "completions", request, _completions(gateway, request))


def chat_runner(gw: Gateway, endpoint: str) -> ChatRunner:
    """How another API (the Responses API) runs the chat requests it translates to: the chat path,
    counted as ``endpoint``."""

    async def run(request: Request, body: ChatCompletionRequest, size: int, make_format: FormatFactory) -> Response:
        return await _counted(gw, endpoint, request, _chat_body(gw, request, body, size, make_format))

    return run


class CompletionRoutes:
    """An ASGI front that serves the two completion routes itself and passes the rest to FastAPI.

    The same handlers run behind FastAPI's routes; here they skip its five middleware layers and
    its routing, which on a 2-core box cost as much CPU per request as the handler itself.
    """

    def __init__(self, app: FastAPI, gateway: Gateway):
        self.app = app
        self.gateway = gateway
        self.routes = {"/v1/chat/completions": ("chat", _chat), "/v1/completions": ("completions", _completions)}

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        endpoint, handler = route
        request = Request(scope, receive)
        try:
            response = await _counted(self.gateway, endpoint, request, handler(self.gateway, request))
        except APIError as e:
            response = e.response()
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            self.gateway.stats.request(endpoint, 500)
            response = APIError(500, "internal error").response()
        await response(scope, receive, send)


async def _counted(gw: Gateway, endpoint: str, request: Request, handler: Awaitable[Response]) -> Response:
    """Run a completion handler inside its server span (continuing the caller's ``traceparent``)
    and count its status. A streamed response ends the span when the stream ends."""
    parent = context_from(dict(request.headers)) if gw.tracing else None  # no-op spans need no parent
    span = TRACER.start_span(f"POST /v1/{endpoint.replace('chat', 'chat/completions')}", context=parent,
                             kind=trace.SpanKind.SERVER,
                             attributes={"http.request.method": "POST", "http.route": request.scope["path"]})
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        response = await handler
    except APIError as e:
        gw.stats.request(endpoint, e.status)
        span.set_attribute("http.response.status_code", e.status)
        span.end()
        raise
    except BaseException:
        span.end()
        raise
    finally:
        otel_context.detach(token)
    gw.stats.request(endpoint, response.status_code)
    span.set_attribute("http.response.status_code", response.status_code)
    if not isinstance(response, SSEResponse):
        span.end()
    return response


async def _parse(request: Request, model: type[BaseModel]):
    """The body as ``model``: any content type, JSON only, OpenAI-shaped 400s."""
    return (await parse_body(request, model))[0]


async def _chat(gw: Gateway, request: Request) -> Response:
    body, size = await parse_body(request, ChatCompletionRequest)
    return await _chat_body(gw, request, body, size, _chat_format)


def _chat_format(gw: Gateway, body: ChatCompletionRequest, target: Target, prompt: list[int]) -> Format:
    return ChatFormat(_request_id("chatcmpl"), body.model, gw.token_texts.get(target.model), [prompt], body.n,
                      body.include_usage, body.return_token_ids)


async def _chat_body(gw: Gateway, request: Request, body: ChatCompletionRequest, size: int,
                     make_format: FormatFactory) -> Response:
    """A parsed chat request (``size``: its body's bytes) answered in the format ``make_format`` makes:
    chat completions, or the Responses API's objects (``gateway.responses``)."""
    target = gw.resolve(body.model)
    tok = gw.require_tokenizer(target.model, "messages")
    messages = body.template_messages()
    try:
        with TRACER.start_as_current_span("template+tokenize") as span:
            # sized by the whole body: tools, tool-call arguments and every message part are rendered too
            text, prompt = await _off_loop(size, _render, tok, body, messages)
            span.set_attribute("pdmesh.prompt_tokens", len(prompt))
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.param) from None
    if not prompt:
        raise APIError(400, "the messages render to an empty prompt", "messages")
    plan = plan_chat(body, tok, text, gw.config.tool_call_parser, gw.config.reasoning_parser)
    return await _complete(gw, body, request, [prompt], make_format(gw, body, target, prompt), plan, target)


def _render(tok: Tokenizer, body: ChatCompletionRequest, messages: list[dict]) -> tuple[str, list[int]]:
    """The chat template's text (the output plan reads it) and its tokens."""
    text = tok.render_chat(messages, body.add_generation_prompt, body.template_tools(), body.chat_template_kwargs)
    return text, tok.encode(text, add_special_tokens=False)


async def _completions(gw: Gateway, request: Request) -> Response:
    body: CompletionRequest = await _parse(request, CompletionRequest)
    target = gw.resolve(body.model)
    raw_prompts = body.prompts()
    prompts = []
    texts = any(isinstance(p, str) for p in raw_prompts)
    with TRACER.start_as_current_span("tokenize") if texts else contextlib.nullcontext():  # token ids: no work
        for p in raw_prompts:
            if isinstance(p, str):
                p = await _off_loop(len(p), gw.require_tokenizer(target.model, "prompt").encode, p)
                if not p:
                    raise APIError(400, "the prompt is empty", "prompt")
            prompts.append(p)
    tok = gw.tokenizer(target.model)
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else (tok.decode(p) if tok else "") for p in raw_prompts]
    fmt = CompletionFormat(_request_id("cmpl"), body.model, gw.token_texts.get(target.model), prompts, body.n,
                           body.include_usage, body.return_token_ids, echo_texts=echo)
    return await _complete(gw, body, request, prompts, fmt, plan_completion(body), target)


async def _off_loop(size: int, fn, *args):
    """``fn(*args)``; in a thread when the input is long (tokenizers release the GIL), so that
    one long prompt does not stall every stream on the event loop."""
    if size < LONG_INPUT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def _check_limits(gw: Gateway, body, prompts: list[list[int]], model: str) -> int:
    """The completion budget; 400s for prompts that cannot fit or ids outside the vocabulary."""
    limit = gw.max_model_len(model)
    longest = max(len(p) for p in prompts)
    max_out = body.max_output
    if longest >= limit or (max_out is not None and longest + max_out > limit):
        asked = longest + (max_out or 1)
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {asked} tokens "
            f"({longest} in the prompt, {max_out or 1} for the completion). Please reduce the length of the "
            f"prompt or the completion.",
            "max_tokens" if max_out and longest < limit else ("messages" if hasattr(body, "messages") else "prompt"),
            "context_length_exceeded",
        )
    tok = gw.tokenizer(model)
    if tok is not None:
        vocab = tok.vocab_size
        bad = next((t for p in prompts for t in p if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {vocab})", "prompt")
    choices = len(prompts) * body.n
    if choices > gw.config.max_inflight:
        raise APIError(400, f"this request asks for {choices} completions; this gateway runs at most "
                            f"{gw.config.max_inflight} at once", "n")
    return max_out if max_out is not None else min(gw.config.default_max_tokens, limit - longest)


def _priority(body, request: Request) -> int:
    """The body's ``priority`` if set, else the ``x-priority`` header (interactive, batch or an int)."""
    if "priority" in body.model_fields_set:
        return body.priority
    return header_priority(request.headers.get("x-priority", ""))


def _sampling(body, max_tokens: int, seed: int | None, constraint: Constraint | None) -> SamplingOptions:
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=body.sampling_temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=seed,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.num_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens,
        speculate=body.speculate,
        constraint=None if constraint is None else ConstraintSpec(constraint.kind.value, constraint.source,
                                                                  constraint.start_after),
    )


class _Admission:
    """``acquire`` now, ``release`` exactly once whichever path ends the request."""

    def __init__(self, gw: Gateway, n: int):
        gw.acquire(n)
        self.gw, self.n = gw, n

    def release(self) -> None:
        if self.n:
            self.gw.release(self.n)
            self.n = 0


async def _complete(gw: Gateway, body, request: Request, prompts: list[list[int]], fmt: Format,
                    plan: OutputPlan, target: Target) -> Response:
    server_span = trace.get_current_span()
    server_span.set_attributes({"pdmesh.request_id": fmt.rid, "pdmesh.model": body.model})
    max_out = _check_limits(gw, body, prompts, target.model)
    key = request.scope.get("state", {}).get("api_key")  # ApiKeys set it; None when keys are off
    priority = clamp_priority(_priority(body, request), key)
    scope = cache_scope(gw.config.router.hash_key, key, body.cache_salt)
    admission = _Admission(gw, len(prompts) * body.n)
    has_tok = gw.tokenizer(target.model) is not None
    # one streamed choice: its mid-stream tokens are written from the reply handler
    # (gateway/choices/direct.py)
    direct = SSEWriter(fmt, has_tok) if body.stream and len(prompts) * body.n == 1 else None
    streams = [
        gw.stream_choice(i, f"{fmt.rid}-{i}", target.model, prompts[i // body.n],
                         _sampling(body, max_out, body.choice_seed(i % body.n), plan.constraint), body.stop_list,
                         priority, plan, target.adapter, cache_scope=scope, direct=direct)
        for i in range(len(prompts) * body.n)
    ]
    headers = {"x-request-id": fmt.rid}
    if not body.stream:
        try:
            results = await unless_disconnected(request.receive, collect_all(streams))
        finally:
            await close_all(streams)
            admission.release()
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(fmt.full(results), headers=headers)
    try:
        first = await unless_disconnected(request.receive, first_deltas(streams))
    except BaseException:
        await close_all(streams)
        admission.release()
        raise
    if first is None:
        await close_all(streams)
        admission.release()
        return Response(status_code=CLIENT_CLOSED)

    def done() -> None:
        admission.release()
        server_span.end()

    return SSEResponse(sse_events(fmt, streams, first, body.include_usage, has_tok, done), headers, direct)
