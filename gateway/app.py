"""The OpenAI-compatible HTTP surface: /v1/chat/completions, /v1/completions, /v1/models,
/health, /metrics. Formatting only; the work is in ``gateway.service``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gateway import errors
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.service import ChoiceDelta, Gateway
from mesh.protocol import SamplingOptions, TokenLogprobs, Usage
from mesh.tokenizer import ChatTemplateError, Tokenizer


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="pdmesh gateway", lifespan=lifespan)
    errors.install(app)
    app.state.gateway = gateway

    @app.get("/health")
    async def health():
        if any(gateway.decode_workers(m) for m in gateway.live_models()):
            return {"status": "ok", "models": gateway.live_models()}
        return JSONResponse({"status": "unavailable", "models": []}, status_code=503)

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "pdmesh",
                 "max_model_len": gateway.max_model_len(m)} for m in gateway.live_models()]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics(gateway), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        gateway.check_model(body.model)
        tok = gateway.require_tokenizer(body.model)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            prompt = tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        return await _complete(gateway, body, request, [prompt], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        gateway.check_model(body.model)
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(gateway.require_tokenizer(body.model).encode(p))
            else:
                prompts.append(p)
        if any(not p for p in prompts):
            raise APIError(400, "the prompt is empty", "prompt")
        return await _complete(gateway, body, request, prompts, chat=False)

    return app


async def _complete(gw: Gateway, body, request: Request, prompts: list[list[int]], chat: bool):
    model = body.model
    limit = gw.max_model_len(model)
    longest = max(len(p) for p in prompts)
    max_out = body.max_output
    if longest >= limit or (max_out is not None and longest + max_out > limit):
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{longest + (max_out or 0)} tokens ({longest} in the prompt, {max_out or 0} for the completion).",
            "max_tokens" if max_out else ("messages" if chat else "prompt"),
            "context_length_exceeded",
        )
    if max_out is None:
        max_out = min(gw.config.default_max_tokens, limit - longest)
    tok = gw.tokenizer(model)
    if tok is not None:
        vocab = tok.vocab_size
        bad = next((t for p in prompts for t in p if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {vocab})", "prompt")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    jobs = []  # (choice index, prompt index, prompt ids, sampling)
    for pi, prompt in enumerate(prompts):
        for k in range(body.n):
            seed = None if body.seed is None else body.seed + k
            jobs.append((len(jobs), pi, prompt, _sampling(body, max_out, seed)))
    gw.acquire(len(jobs))
    headers = {"x-request-id": rid}
    fmt = _ChatFormat(rid, model, tok) if chat else _CompletionFormat(rid, model, tok, body, prompts)
    streams = [
        gw.stream_choice(i, f"{rid}-{i}", model, p, s, body.stop_list, body.priority) for i, _, p, s in jobs
    ]
    if not body.stream:
        try:
            results = await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            await _close(streams)
            gw.release(len(jobs))
        return JSONResponse(fmt.full(results), headers=headers)
    try:
        first = await _first_events(streams)  # errors before the first byte are real HTTP errors
    except BaseException:
        await _close(streams)
        gw.release(len(jobs))
        raise
    return StreamingResponse(
        _sse(fmt, streams, first, body.include_usage, lambda: gw.release(len(jobs))),
        media_type="text/event-stream", headers=headers,
    )


def _sampling(body, max_tokens: int, seed: int | None) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=seed,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.num_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )


async def _collect(stream: AsyncIterator[ChoiceDelta]) -> list[ChoiceDelta]:
    return [d async for d in stream]


async def _first_events(streams: list[AsyncIterator[ChoiceDelta]]) -> list[ChoiceDelta | None]:
    async def first(s):
        return await anext(s, None)

    return list(await asyncio.gather(*(first(s) for s in streams)))


async def _close(streams) -> None:
    """Close choice streams (an unfinished one cancels its request on the worker)."""
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def _sse(fmt, streams, first: list[ChoiceDelta | None], include_usage: bool, release) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream, head):
        try:
            if head is not None:
                await queue.put(head)
                if head.finish_reason is None:
                    async for d in stream:
                        await queue.put(d)
        except APIError as e:
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s, h)) for s, h in zip(streams, first, strict=True)]
    usage: dict[int, Usage] = {}
    try:
        for i in range(len(streams)):
            yield _event(fmt.role_chunk(i, include_usage))
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, APIError):
                yield _event(item.body())
                continue
            if item.usage is not None:
                usage[item.index] = item.usage
            yield _event(fmt.chunk(item, include_usage))
        if include_usage:
            yield _event(fmt.usage_chunk(_sum_usage(usage.values())))
        yield "data: [DONE]\n\n"
    finally:
        # Client gone or stream done: stop the pumps, then close the streams (which cancels on the worker).
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)
        release()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _sum_usage(items) -> Usage:
    items = list(items)
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in items),
        completion_tokens=sum(u.completion_tokens for u in items),
        cached_tokens=sum(u.cached_tokens for u in items),
    )


def _usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _token_text(tok: Tokenizer | None, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False) if tok else f"token_id:{tid}"


class _ChatFormat:
    def __init__(self, rid: str, model: str, tok: Tokenizer | None):
        self.rid, self.model, self.tok = rid, model, tok
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, ids: list[int], lps: list[TokenLogprobs]) -> dict | None:
        if not lps:
            return None
        content = []
        for tid, lp in zip(ids, lps, strict=False):
            text = _token_text(self.tok, tid)
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := _token_text(self.tok, i)), "logprob": v, "bytes": list(t.encode())}
                    for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False)
                ],
            })
        return {"content": content}

    def role_chunk(self, index: int, include_usage: bool) -> dict:
        out = self._base("chat.completion.chunk")
        out["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}]
        if include_usage:
            out["usage"] = None
        return out

    def chunk(self, d: ChoiceDelta, include_usage: bool) -> dict:
        out = self._base("chat.completion.chunk")
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        out["choices"] = [{"index": d.index, "delta": delta, "logprobs": self._logprobs(d.token_ids, d.logprobs),
                           "finish_reason": d.finish_reason}]
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._base("chat.completion.chunk")
        out["choices"] = []
        out["usage"] = _usage_json(usage)
        return out

    def full(self, results: list[list[ChoiceDelta]]) -> dict:
        out = self._base("chat.completion")
        choices, usages = [], []
        for i, deltas in enumerate(results):
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            last = deltas[-1] if deltas else ChoiceDelta(i, finish_reason="abort")
            if last.usage:
                usages.append(last.usage)
            choices.append({
                "index": i,
                "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                "logprobs": self._logprobs(ids, lps),
                "finish_reason": last.finish_reason,
            })
        out["choices"] = choices
        out["usage"] = _usage_json(_sum_usage(usages))
        return out


class _CompletionFormat:
    def __init__(self, rid: str, model: str, tok: Tokenizer | None, body: CompletionRequest,
                 prompts: list[list[int]]):
        self.rid, self.model, self.tok = rid, model, tok
        self.created = int(time.time())
        self.echo = body.echo
        self.n = body.n
        self.prompt_texts = [
            (p if isinstance(p, str) else (tok.decode(p) if tok else "")) for p in body.prompts()
        ]
        self._echoed: set[int] = set()

    def _base(self) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}

    def _prefix(self, index: int) -> str:
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            return self.prompt_texts[index // self.n]
        return ""

    def _logprobs(self, ids: list[int], lps: list[TokenLogprobs]) -> dict | None:
        if not lps:
            return None
        tokens = [_token_text(self.tok, t) for t in ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {_token_text(self.tok, i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False)}
                for lp in lps
            ],
            "text_offset": offsets,
        }

    def role_chunk(self, index: int, include_usage: bool) -> dict:
        out = self._base()
        out["choices"] = [{"index": index, "text": self._prefix(index), "logprobs": None, "finish_reason": None}]
        if include_usage:
            out["usage"] = None
        return out

    def chunk(self, d: ChoiceDelta, include_usage: bool) -> dict:
        out = self._base()
        out["choices"] = [{"index": d.index, "text": self._prefix(d.index) + d.text,
                           "logprobs": self._logprobs(d.token_ids, d.logprobs), "finish_reason": d.finish_reason}]
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._base()
        out["choices"] = []
        out["usage"] = _usage_json(usage)
        return out

    def full(self, results: list[list[ChoiceDelta]]) -> dict:
        out = self._base()
        choices, usages = [], []
        for i, deltas in enumerate(results):
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            last = deltas[-1] if deltas else ChoiceDelta(i, finish_reason="abort")
            if last.usage:
                usages.append(last.usage)
            choices.append({
                "index": i, "text": self._prefix(i) + "".join(d.text for d in deltas),
                "logprobs": self._logprobs(ids, lps), "finish_reason": last.finish_reason,
            })
        out["choices"] = choices
        out["usage"] = _usage_json(_sum_usage(usages))
        return out


def _metrics(gw: Gateway) -> str:
    lines = [
        "# HELP pdmesh_gateway_inflight_requests Requests admitted and not finished.",
        "# TYPE pdmesh_gateway_inflight_requests gauge",
        f"pdmesh_gateway_inflight_requests {gw.inflight}",
        "# HELP pdmesh_gateway_live_workers Ready decode workers per model.",
        "# TYPE pdmesh_gateway_live_workers gauge",
    ]
    for m in gw.live_models():
        lines.append(f'pdmesh_gateway_live_workers{{model="{m}"}} {len(gw.decode_workers(m))}')
    return "\n".join(lines) + "\n"
