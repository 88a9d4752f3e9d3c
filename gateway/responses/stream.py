"""A response's output as Responses objects: the whole ``Response``, or its typed stream events.

One ``ResponseFormat`` per request, a ``gateway.formats.Format`` that the chat path drives
(``_complete`` in gateway/completions/routes.py): ``full`` for a whole response,
``opening``/``chunks``/``closing`` for a stream. Both feed the choice's deltas to the same
``OutputItems``, so a stream's events add up to the whole response by construction. A delta's
parts open items in order:

    reasoning text  -> a ``reasoning`` item    (reasoning_text.delta)
    content text    -> a ``message`` item      (output_text.delta)
    a tool call     -> a ``function_call`` item (function_call_arguments.delta)

Opening an item closes the one before it (its .done events); the finish reason closes the last.
A stream: response.created, response.in_progress, the items' events, then (after ``save`` stored
the response) response.completed, or response.incomplete when max_output_tokens cut it short, or
an ``error`` event and response.failed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.errors import APIError
from gateway.formats import Format
from gateway.service import ChoiceDelta

Saver = Callable[[dict], Awaitable[None]]


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class _Item:
    """One output item being written: its object, and where its text goes."""

    def __init__(self, index: int, item: dict, field: str):
        self.index, self.item, self.field = index, item, field
        self.text = ""

    @property
    def id(self) -> str:
        return self.item["id"]


class OutputItems:
    """The output items of one response as deltas arrive; each method returns its stream events
    (without sequence numbers: ``ResponseFormat`` numbers them)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # a tool call's index in the choice -> its item

    def feed(self, d: ChoiceDelta) -> list[dict]:
        events: list[dict] = []
        if d.reasoning:
            events += self._text("reasoning", d.reasoning)
        if d.text:
            events += self._text("message", d.text)
        for call in d.tool_calls or ():
            events += self._call(call)
        if d.finish_reason is not None:
            events += self.close("incomplete" if d.finish_reason == "length" else "completed")
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open.item["type"] == kind else self._start_text(kind)
        self.open.text += text
        o = self.open
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": name, "item_id": o.id, "output_index": o.index, "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return [*events, event]

    def _start_text(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = self._add(item, "text")
        return [*events, {"type": "response.content_part.added", "item_id": item["id"],
                          "output_index": self.open.index, "content_index": 0, "part": part}]

    def _call(self, call) -> list[dict]:
        if call.id is not None:
            item = {"id": item_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            events = self._add(item, "arguments")
            self.calls[call.index] = self.open
        else:
            events = []
        target = self.calls.get(call.index)
        if target is None or not call.arguments:
            return events
        target.text += call.arguments
        return [*events, {"type": "response.function_call_arguments.delta", "item_id": target.id,
                          "output_index": target.index, "delta": call.arguments}]

    def _add(self, item: dict, field: str) -> list[dict]:
        events = self.close("completed")
        self.open = _Item(len(self.items), item, field)
        self.items.append(item)
        return [*events, {"type": "response.output_item.added", "output_index": self.open.index,
                          "item": dict(item)}]

    def close(self, status: str) -> list[dict]:
        """End the open item (``status``: completed, or incomplete when the output was cut short)."""
        o, self.open = self.open, None
        if o is None:
            return []
        item, where = o.item, {"item_id": o.id, "output_index": o.index}
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = o.text
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": o.text}]
        else:
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": o.text}
                done = {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": o.text}
            else:
                part = {"type": "output_text", "text": o.text, "annotations": [], "logprobs": []}
                done = {"type": "response.output_text.done", **where, "content_index": 0, "text": o.text,
                        "logprobs": []}
            item["content"] = [part]
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        return [*events, {"type": "response.output_item.done", "output_index": o.index, "item": item}]


class ResponseFormat(Format):
    """The Responses API's ``Format``: ``echo`` holds the request's fields a Response repeats
    (model, instructions, tools, ...); ``save`` stores a finished response (None: ``store`` false)."""

    def __init__(self, rid: str, prompt: list[int], echo: dict, save: Saver | None = None):
        super().__init__(rid, echo["model"], None, [prompt], 1)
        self.echo, self.save = echo, save
        self.created_at = int(time.time())
        self.output = OutputItems()
        self.finish_reason: str | None = None
        self.error: APIError | None = None
        self.seq = 0
        self.response: dict | None = None  # the finished response, once built

    def snapshot(self, status: str) -> dict:
        """The Response object as it stands (``status``: in_progress, completed, incomplete, failed)."""
        out = {"id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
               "error": None, "incomplete_details": None, **self.echo, "output": self.output.items,
               "usage": None}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed" and self.error is not None:
            out["error"] = {"code": self.error.code or "server_error", "message": self.error.message}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
            out["usage"] = self.response_usage()
        return out

    def response_usage(self) -> dict:
        u = self.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def _feed(self, d: ChoiceDelta) -> list[dict]:
        self.note_usage(d)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        return self.output.feed(d)

    def _finish(self) -> dict:
        status = "failed" if self.error is not None else "incomplete" if self.finish_reason == "length" else "completed"
        self.output.close("incomplete")  # a choice that ended without a finish reason
        self.response = self.snapshot(status)
        return self.response

    # -- the whole response --------------------------------------------------------------
    def full(self, results: list[list[ChoiceDelta]]) -> dict:
        for d in results[0]:
            self._feed(d)
        return self._finish()

    # -- the stream ------------------------------------------------------------------------
    def _events(self, events: list[dict]) -> str:
        out = []
        for e in events:
            e["sequence_number"] = self.seq
            self.seq += 1
            out.append(sse(e))
        return "".join(out)

    def opening(self, n: int) -> str:
        return self._events([{"type": "response.created", "response": self.snapshot("in_progress")},
                             {"type": "response.in_progress", "response": self.snapshot("in_progress")}])

    def chunks(self, d: ChoiceDelta, has_tokenizer: bool) -> str:
        return self._events(self._feed(d))

    def error_event(self, error: APIError) -> str:
        self.error = error
        return self._events([{"type": "error", "code": error.code or "server_error", "message": error.message,
                              "param": error.param}])

    async def closing(self, include_usage: bool) -> AsyncIterator[str]:
        response = self._finish()
        if self.save is not None and self.error is None:
            try:
                await self.save(response)
            except APIError as e:
                yield self.error_event(e)
                response = self._finish()
        yield self._events([{"type": f"response.{response['status']}", "response": response}])
