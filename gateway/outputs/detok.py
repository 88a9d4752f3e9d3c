"""Incremental detokenization, stop strings, and the text and bytes of single tokens.

Byte-level tokenizers split multi-byte characters across tokens; decoding a
token alone yields U+FFFD. ``IncrementalDetokenizer`` steps tokenizers'
``DecodeStream`` (one native call per token), which holds text back while it
ends in an incomplete character; the last push re-decodes a short window to
give out what is still held.
``StopMatcher`` holds back the last ``len(longest stop) - 1`` characters, so a
stop string spanning several tokens is never partly streamed before it is
recognized; the stop string itself is not returned.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from mesh.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """``keep_special``: special tokens that are still written out when the others are skipped
    (the markers a tool-call or reasoning parser reads, where they are special tokens: Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``); the other special tokens are dropped as they come."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 keep_special: frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.drop: frozenset[int] = frozenset()
        if skip_special_tokens and keep_special:
            self.skip, self.drop = False, tokenizer.special_ids - keep_special
        self.ids: list[int] = []
        self._step = tokenizer.decode_stream(self.skip)
        self._held = 0  # the last ids whose text has not come out (an incomplete character)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete; ``final``: the last tokens, so hold nothing back."""
        if self.drop:
            new_ids = [t for t in new_ids if t not in self.drop]
        self.ids.extend(new_ids)
        step = self._step
        out = ""
        for t in new_ids:
            piece = step(t)
            if piece is None:
                self._held += 1
            else:
                out += piece
                self._held = 0
        if final and self._held:
            out += self._tail()
            self._held = 0
        return out

    def _tail(self) -> str:
        """The text of the held ids, U+FFFD for an incomplete character (decoded after a few ids of
        context, so that the tokenizer's spacing rules see them)."""
        ids, n = self.ids, self._held
        ctx = ids[max(0, len(ids) - n - 4) : len(ids) - n]
        prefix = self.tok.decode(ctx, self.skip) if ctx else ""
        return self.tok.decode(ctx + ids[len(ids) - n :], self.skip)[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self.push([], final=True)


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``stopped`` when a stop string appears (and drops it)."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.buf = self.buf[: min(hits)], ""
            return out
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out

    def skip(self, text: str) -> str:
        """Text that no stop string may match (before ``min_tokens``): passed through with what was held."""
        out, self.buf = self.buf + text, ""
        return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenTexts:
    """Each token's own bytes and text, for logprobs (cached: the same ids recur all the time).

    A token that is part of a multi-byte character has no text of its own; like OpenAI, its
    text is then ``bytes:\\xe4\\xbd``, and its ``bytes`` are the real bytes, so joining the
    bytes of a completion's tokens gives back its UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer, model_dir: str | Path):
        self.tok = tokenizer
        self._byte_level = _is_byte_level(Path(model_dir) / "tokenizer.json")
        self._bytes_of = _byte_decoder() if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return f"token_id:{token_id}", b""
        raw = None
        if self._byte_level and all(c in self._bytes_of for c in piece):
            raw = bytes(self._bytes_of[c] for c in piece)
        if raw is None:  # an added/special token, or not a byte-level vocabulary
            text = self.tok.decode([token_id], skip_special_tokens=False)
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """Character offset of each token in the text its bytes make (completions' ``text_offset``)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, pos = [], start
    for b in pieces:
        out.append(pos)
        pos += len(dec.decode(b))
    return out


def _is_byte_level(tokenizer_json: Path) -> bool:
    """Does the tokenizer decode with GPT-2's byte-level alphabet (Llama 3, Qwen, GPT-2)?"""
    try:
        spec = json.loads(tokenizer_json.read_text())
    except (OSError, ValueError):
        return False
    dec = spec.get("decoder") or {}
    kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", []) or []]
    return "ByteLevel" in kinds
