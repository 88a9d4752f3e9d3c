"""OpenAI's completion shapes: chat and text completions, whole and as SSE chunks.

The shapes follow OpenAI's exactly: a chat stream opens with a role delta, content deltas never
carry a finish reason, the last chunk of a choice has an empty delta and the finish reason, and
with ``include_usage`` every chunk has ``"usage": null`` and a last chunk with no choices carries
the usage. What every shape shares (ids, usage, the pre-rendered chunk frame) is
``gateway.formats.Format``.
"""

from __future__ import annotations

import codecs
from json.encoder import encode_basestring_ascii as _js

from gateway.formats import Format, TextFrame, compact_json
from gateway.service import ChoiceDelta
from mesh.protocol import TokenLogprobs

MIN_LOGPROB = -9999.0  # -inf is not JSON; OpenAI and vLLM floor it the same way


def _lp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


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
            lp = compact_json(self.logprobs(d.token_ids, d.logprobs)) if d.logprobs else "null"
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
            parts.append(f'"tool_calls":{compact_json([t.to_openai() for t in d.tool_calls])}')
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
        return (f'{self._head}{d.index},"text":{_js(prefix + d.text)},"logprobs":{compact_json(lp) if lp else "null"},'
                f'"finish_reason":{reason}{self._ids(d)}{self._tail}')

    full_object = "text_completion"

    def full_choice(self, i: int, deltas: list[ChoiceDelta], ids: list[int], lps: list) -> dict:
        prefix = self._prefix(i)
        return {
            "index": i, "text": prefix + "".join(d.text for d in deltas),
            "logprobs": self.logprobs(i, ids, lps, len(prefix)),
        }
