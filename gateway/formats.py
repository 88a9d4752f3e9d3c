"""OpenAI's response shapes: chat and text completions, whole and as SSE chunks.

Chunks are the hot path (one per token batch per request), so a chunk is a
pre-rendered head and tail around the few fields that change, not a dict run
through ``json.dumps``. The shapes follow OpenAI's exactly: a chat stream
opens with a role delta, content deltas never carry a finish reason, the last
chunk of a choice has an empty delta and the finish reason, and with
``include_usage`` every chunk has ``"usage": null`` and a last chunk with no
choices carries the usage.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import AsyncIterator
from json.encoder import encode_basestring_ascii as _js
from typing import NamedTuple

from gateway.detok import TokenTexts
from gateway.service import ChoiceDelta
from mesh.protocol import TokenLogprobs, Usage

MIN_LOGPROB = -9999.0  # -inf is not JSON; OpenAI and vLLM floor it the same way


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _lp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


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
        head = _dumps({"id": rid, "object": self.chunk_object, "created": self.created, "model": model})
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
        return f"data: {_dumps(out)}\n\n"

    def _ids(self, d: ChoiceDelta) -> str:
        return f',"token_ids":{_dumps(d.token_ids)}' if self.return_token_ids else ""

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


class ChatFormat(Format):
    chunk_object = "chat.completion.chunk"

    def text_frame(self, index: int) -> TextFrame | None:
        if self.return_token_ids:
            return None
        return TextFrame.of(f'{self._head}{index},"delta":{{"content":',
                            f'}},"logprobs":null,"finish_reason":null{self._tail}')

    def logprobs(self, ids: list[int], lps: list[TokenLogprobs]) -> dict | None:
        if not lps:
            return None
        content = []
        for tid, lp in zip(ids, lps, strict=False):
            text, raw = self.token_text(tid)
            top = []
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False):
                t, b = self.token_text(i)
                top.append({"token": t, "logprob": _lp(v), "bytes": list(b)})
            content.append({"token": text, "logprob": _lp(lp.logprob), "bytes": list(raw), "top_logprobs": top})
        return {"content": content}

    def opening(self, n: int) -> str:
        """A chat stream opens with each choice's role delta."""
        return "".join(f'{self._head}{i},"delta":{{"role":"assistant","content":""}},'
                       f'"logprobs":null,"finish_reason":null{self._tail}' for i in range(n))

    def chunks(self, d: ChoiceDelta, has_tokenizer: bool) -> str:
        """The SSE events for one delta: content (if any), then the finish chunk (if it is the last)."""
        self.note_usage(d)
        out = ""
        if (d.text or d.logprobs or d.reasoning or d.tool_calls
                or (d.token_ids and (not has_tokenizer or self.return_token_ids))):
            lp = _dumps(self.logprobs(d.token_ids, d.logprobs)) if d.logprobs else "null"
            out = (f'{self._head}{d.index},"delta":{self._delta(d)},"logprobs":{lp},'
                   f'"finish_reason":null{self._ids(d)}{self._tail}')
        if d.finish_reason is not None:
            out += f'{self._head}{d.index},"delta":{{}},"logprobs":null,"finish_reason":{_js(d.finish_reason)}{self._tail}'
        return out

    @staticmethod
    def _delta(d: ChoiceDelta) -> str:
        """The delta object: the content, and the reasoning and tool-call fragments a parser found."""
        if not (d.reasoning or d.tool_calls):
            return f'{{"content":{_js(d.text)}}}'
        parts = []
        if d.reasoning:
            parts.append(f'"reasoning_content":{_js(d.reasoning)}')
        if d.text or not d.tool_calls:
            parts.append(f'"content":{_js(d.text)}')
        if d.tool_calls:
            parts.append(f'"tool_calls":{_dumps([t.to_openai() for t in d.tool_calls])}')
        return "{" + ",".join(parts) + "}"

    full_object = "chat.completion"

    def full_choice(self, i: int, deltas: list[ChoiceDelta], ids: list[int], lps: list) -> dict:
        content = "".join(d.text for d in deltas)
        message: dict = {"role": "assistant", "content": content}
        reasoning = "".join(d.reasoning for d in deltas)
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = tool_calls(deltas)
        if calls:
            message["tool_calls"] = calls
            message["content"] = content or None  # OpenAI: null when the message is only tool calls
        return {"index": i, "message": message, "logprobs": self.logprobs(ids, lps)}


def tool_calls(deltas: list[ChoiceDelta]) -> list[dict]:
    """The whole calls that a choice's tool-call deltas add up to (OpenAI's ``message.tool_calls``)."""
    calls: list[dict] = []
    for d in deltas:
        for t in d.tool_calls or ():
            if t.id is not None:
                calls.append({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}})
            else:
                calls[t.index]["function"]["arguments"] += t.arguments
    return calls


class CompletionFormat(Format):
    chunk_object = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None = None, **kw):
        super().__init__(*args, **kw)
        self.echo_texts = echo_texts  # the prompt texts, when echoing
        self._echoed: set[int] = set()
        self._offsets: dict[int, tuple[int, codecs.IncrementalDecoder]] = {}

    def _prefix(self, index: int) -> str:
        if self.echo_texts is not None and index not in self._echoed:
            self._echoed.add(index)
            return self.echo_texts[index // self.n]
        return ""

    def logprobs(self, index: int, ids: list[int], lps: list[TokenLogprobs], start: int) -> dict | None:
        """``text_offset`` continues across the chunks of a choice (from ``start``, past any echo)."""
        if not lps:
            return None
        pos, dec = self._offsets.get(index) or (start, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        tokens, offsets, tops = [], [], []
        for tid, lp in zip(ids, lps, strict=False):
            text, raw = self.token_text(tid)
            tokens.append(text)
            offsets.append(pos)
            pos += len(dec.decode(raw)) if self.texts else 0
            tops.append({self.token_text(i)[0]: _lp(v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False)})
        self._offsets[index] = (pos, dec)
        return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps], "top_logprobs": tops,
                "text_offset": offsets}

    def text_frame(self, index: int) -> TextFrame | None:
        if self.return_token_ids or (self.echo_texts is not None and index not in self._echoed):
            return None
        return TextFrame.of(f'{self._head}{index},"text":', f',"logprobs":null,"finish_reason":null{self._tail}')

    def chunks(self, d: ChoiceDelta, has_tokenizer: bool) -> str:
        self.note_usage(d)
        prefix = self._prefix(d.index)
        if not (prefix or d.text or d.logprobs or d.finish_reason is not None
                or (d.token_ids and (not has_tokenizer or self.return_token_ids))):
            return ""
        lp = self.logprobs(d.index, d.token_ids, d.logprobs, len(prefix)) if d.logprobs else None
        reason = "null" if d.finish_reason is None else _js(d.finish_reason)
        return (f'{self._head}{d.index},"text":{_js(prefix + d.text)},"logprobs":{_dumps(lp) if lp else "null"},'
                f'"finish_reason":{reason}{self._ids(d)}{self._tail}')

    full_object = "text_completion"

    def full_choice(self, i: int, deltas: list[ChoiceDelta], ids: list[int], lps: list) -> dict:
        prefix = self._prefix(i)
        return {
            "index": i, "text": prefix + "".join(d.text for d in deltas),
            "logprobs": self.logprobs(i, ids, lps, len(prefix)),
        }
