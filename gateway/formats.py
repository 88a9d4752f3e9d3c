"""What every response shape the chat path writes shares, whole and as SSE chunks: ``Format``.

The shapes: chat and text completions (``gateway.completions.formats``), the Responses API's
objects and events (``gateway.responses.stream``). Chunks are the hot path (one per token batch
per request), so a chunk is a pre-rendered head and tail around the few fields that change, not a
dict run through ``json.dumps``; ``TextFrame`` is that frame for a delta of only text.

An API that runs through the chat path (``gateway.completions.routes``) makes its own ``Format``
for each request (``FormatFactory``); ``ChatRunner`` is the chat path as such an API is handed it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import Response

from gateway.outputs.detok import TokenTexts
from gateway.requests.schemas import ChatCompletionRequest
from gateway.service import ChoiceDelta, Gateway, Target
from mesh.protocol import Usage


def compact_json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Format:
    """What chat and completions share: ids, the usage over choices, the per-chunk frame."""

    chunk_object = ""

    def __init__(self, rid: str, model: str, texts: TokenTexts | None, prompts: list[list[int]], n: int,
                 include_usage: bool = False, return_token_ids: bool = False):
        self.rid, self.model, self.texts = rid, model, texts
        self.created = int(time.time())
        self.prompts, self.n = prompts, n
        self.return_token_ids = return_token_ids
        head = compact_json({"id": rid, "object": self.chunk_object, "created": self.created, "model": model})
        self._head = "data: " + head[:-1] + ',"choices":[{"index":'
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"
        self._usage: dict[int, Usage] = {}

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def token_text(self, tid: int) -> tuple[str, bytes]:
        return self.texts.get(tid) if self.texts else (f"token_id:{tid}", b"")

    def note_usage(self, d: ChoiceDelta) -> None:
        if d.usage is not None:
            self._usage[d.index] = d.usage

    def usage(self) -> dict:
        """Prompt tokens count once per prompt (not once per choice), as OpenAI counts them."""
        completion = sum(u.completion_tokens for u in self._usage.values())
        cached = 0
        for p in range(len(self.prompts)):
            mine = [u.cached_tokens for i, u in self._usage.items() if i // self.n == p]
            cached += max(mine, default=0)
        return usage_json(sum(len(p) for p in self.prompts), completion, cached)

    full_object = ""

    def full_choice(self, i: int, deltas: list[ChoiceDelta], ids: list[int], lps: list) -> dict:
        raise NotImplementedError

    def full(self, results: list[list[ChoiceDelta]]) -> dict:
        """The whole (not streamed) response: one choice per result, then the usage."""
        out = self._base(self.full_object)
        choices = []
        for i, deltas in enumerate(results):
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            for d in deltas:
                self.note_usage(d)
            choice = self.full_choice(i, deltas, ids, lps)
            choice["finish_reason"] = deltas[-1].finish_reason if deltas else "abort"
            if self.return_token_ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = self.prompts[i // self.n]
            choices.append(choice)
        out["choices"] = choices
        out["usage"] = self.usage()
        return out

    def opening(self, n: int) -> str:
        """What a stream starts with, before any token."""
        return ""

    def error_event(self, error) -> str:
        """A choice's ``APIError`` after the stream started (its HTTP status is already 200)."""
        return error.sse()

    async def closing(self, include_usage: bool) -> AsyncIterator[str]:
        """What a stream ends with once every choice has ended."""
        if include_usage:
            yield self.usage_chunk()
        yield "data: [DONE]\n\n"

    def usage_chunk(self) -> str:
        out = self._base(self.chunk_object)
        out["choices"] = []
        out["usage"] = self.usage()
        return f"data: {compact_json(out)}\n\n"

    def _ids(self, d: ChoiceDelta) -> str:
        return f',"token_ids":{compact_json(d.token_ids)}' if self.return_token_ids else ""

    def text_frame(self, index: int) -> TextFrame | None:
        """What ``chunks`` writes around the text of a mid-stream delta of choice ``index`` that
        carries only text (no logprobs, reasoning, tool calls, token ids), pre-encoded for
        ``SSEWriter.write_text``; None while such a delta of the choice would carry more."""
        return None


class TextFrame(NamedTuple):
    """An SSE event of plain text is ``head + JSON string + tail`` (``Format.text_frame``)."""

    head: bytes
    tail: bytes
    size: int  # len(head) + len(tail)

    @classmethod
    def of(cls, head: str, tail: str) -> TextFrame:
        h, t = head.encode(), tail.encode()
        return cls(h, t, len(h) + len(t))


# how an API that runs through the chat path makes each request's format, and runs the request
FormatFactory = Callable[[Gateway, ChatCompletionRequest, Target, list[int]], Format]
ChatRunner = Callable[[Request, ChatCompletionRequest, int, FormatFactory], Awaitable[Response]]
