"""Tokenization and chat templates, from a model directory's own files.

``tokenizer.json`` through HF ``tokenizers``; the chat template from
``tokenizer_config.json`` rendered with Jinja2 in a sandbox, the way
transformers renders it. A completion prompt is encoded with the tokenizer's
special tokens (BOS where the model has one); a rendered chat template already
contains them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from mesh.errors import ModelError


class ChatTemplateError(ValueError):
    """The chat template failed to render these messages (``param``: the request field at fault)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(f"{model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ModelError(f"cannot load {tok_file}: {e}") from None
        cfg_file = model_dir / "tokenizer_config.json"
        cfg: dict = {}
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None
        self.config = cfg
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        self.chat_template: str | None = template or None
        self.template_uses_tools = False
        if template:
            env = _template_env()
            self._template = env.from_string(template)
            variables = meta.find_undeclared_variables(env.parse(template))
            self.template_uses_tools = bool({"tools", "custom_tools"} & variables)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # a decoder that makes each token's text alone (by whether it comes first): streams decode
        # through TokenPieces, not tokenizers' DecodeStream (the same text; see SeparableStream)
        self._separable = type(self._tok.decoder).__name__ in SEPARABLE_DECODERS
        self._pieces: dict[bool, TokenPieces] = {}

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the same ids as ``encode`` without the offsets (a third less CPU on a 100-word chat prompt)
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """One stream's incremental decoder: each token id in, the text it completes out (None
        while it ends inside a character, or adds no text)."""
        if self._separable:
            pieces = self._pieces.get(skip_special_tokens)
            if pieces is None:
                pieces = self._pieces[skip_special_tokens] = TokenPieces(self, skip_special_tokens)
            return SeparableStream(pieces)
        return partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tok)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of every special token (what ``decode(skip_special_tokens=True)`` drops)."""
        return frozenset(self._special.values())

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one special token of this tokenizer (a control marker)."""
        return self._special.get(text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The template rendered as transformers' ``apply_chat_template`` renders it: ``tools`` are
        OpenAI tool objects (``{"type": "function", "function": {...}}``); ``template_kwargs`` are
        extra variables (``enable_thinking``)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if tools and not self.template_uses_tools:
            raise ChatTemplateError("this model's chat template cannot render tools", "tools")
        try:
            return self._template.render({
                **(template_kwargs or {}),  # never in place of what follows
                "messages": messages,
                "tools": tools or None,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            })
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes ``<`` and ``>`` for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (same filters and globals)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


# Decoders whose text of a token list is each kept token's own text, joined, where a token's text
# depends only on whether it is the first kept one: WordPiece glues "##" pieces, puts a space
# before any other token but the first, and cleans each token's text up on its own.
SEPARABLE_DECODERS = frozenset({"WordPiece"})


class TokenPieces:
    """Each token's text first and after another token, under a separable decoder (decoded once,
    kept: ``SeparableStream`` joins them). None for a token that ``decode`` drops (a special token
    when they are skipped, an id with no token)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool):
        self.tok = tok
        self.skip = skip_special_tokens
        self.special = tok.special_ids
        self._known: dict[int, tuple[str, str] | None] = {}
        self._anchor = self._find_anchor()

    def _find_anchor(self) -> tuple[int, str]:
        """A kept token with text of its own, to decode each token after (its text is then cut off)."""
        for i in range(self.tok.vocab_size):
            if i not in self.special and self.tok.id_to_token(i) is not None:
                text = self.tok.decode([i], False)
                if text and not text.endswith("\ufffd"):
                    return i, text
        raise ModelError("the tokenizer has no token with text of its own")

    def get(self, token_id: int) -> tuple[str, str] | None:
        known = self._known
        if token_id in known:
            return known[token_id]
        pieces = None
        if self.tok.id_to_token(token_id) is not None and not (self.skip and token_id in self.special):
            anchor, text = self._anchor
            after = self.tok.decode([anchor, token_id], self.skip)
            pieces = (self.tok.decode([token_id], self.skip), after[len(text):])
        if token_id < self.tok.vocab_size:  # not ids past it: what a worker sends must not grow this
            known[token_id] = pieces
        return pieces


class SeparableStream:
    """``tokenizers.decoders.DecodeStream.step`` (tokenizers 0.2x) for a separable decoder: the same
    window of ids, the same text out (None while the text does not grow or ends in U+FFFD), but each
    window's text is joined from ``TokenPieces`` instead of decoded twice per token (WordPiece's
    cleanup makes that step ~20k instructions a token; this, a few dict lookups)."""

    __slots__ = ("get", "ids", "prefix", "prefix_index")

    def __init__(self, pieces: TokenPieces):
        self.get = pieces.get
        self.ids: list[int] = []
        self.prefix = ""
        self.prefix_index = 0

    def _text(self, ids: list[int]) -> str:
        out, first = [], True
        for t in ids:
            p = self.get(t)
            if p is not None:
                out.append(p[0] if first else p[1])
                first = False
        return "".join(out)

    def __call__(self, token_id: int) -> str | None:
        ids = self.ids
        if len(ids) == 1 and self.prefix:
            # the usual step: the window is the last token, kept (it has text), so the window's
            # text is that token's (the prefix) and then the new one's, if it adds any
            p = self.get(token_id)
            if p is not None and (piece := p[1]) and not piece.endswith("\ufffd"):
                ids[0] = token_id
                self.prefix = p[0]
                return piece
        ids.append(token_id)
        text = self._text(ids)
        prefix = self.prefix
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return None
        if not text.startswith(prefix):  # never, for a separable decoder; DecodeStream raises too
            raise ValueError("the stream's text no longer starts with what it gave out")
        new_index = len(ids) - self.prefix_index
        del ids[: self.prefix_index]
        self.prefix = self._text(ids)
        self.prefix_index = new_index
        return text[len(prefix):]
