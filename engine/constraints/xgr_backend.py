"""xgrammar: a pushdown automaton with per-state token masks precomputed at compile time.

The alternative backend (``--grammar-backend xgrammar``, ``pip install pdmesh[xgrammar]``): it
takes JSON schemas, json_object and regexes, not Lark grammars (so not the tool-call grammars).
Its compile is slow for large vocabularies and its runtime masks fast; docs/benchmarks.md compares
the two. A grammar it has finished accepts only EOS, and the sequence ends when EOS is sampled.
"""

from __future__ import annotations

from functools import partial

import torch
import xgrammar as xgr

from mesh.constraints.spec import JSON_STYLE, Constraint, ConstraintError, ConstraintKind

_SEPARATORS = (JSON_STYLE["item_separator"], JSON_STYLE["key_separator"])


class XGrammarMatcher:
    __slots__ = ("raw",)

    def __init__(self, raw: xgr.GrammarMatcher):
        self.raw = raw

    def consume(self, token_id: int) -> bool:
        return self.raw.accept_token(token_id)

    def try_consume(self, token_ids: list[int]) -> int:
        n = 0
        for t in token_ids:  # a refused token leaves the matcher where it was
            if self.raw.is_terminated() or not self.raw.accept_token(t):
                break
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.raw.rollback(num_tokens)

    @property
    def is_done(self) -> bool:
        return self.raw.is_terminated()

    @property
    def error(self) -> str:
        return ""


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int = 0):
        from tokenizers import Tokenizer

        # xgrammar reads vocabularies through transformers
        from transformers import PreTrainedTokenizerFast

        self.vocab_size = vocab_size
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads or 8, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads or "auto")

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        try:
            if c.kind is ConstraintKind.JSON_SCHEMA:
                return self.compiler.compile_json_schema(c.source, any_whitespace=False, separators=_SEPARATORS)
            if c.kind is ConstraintKind.JSON_OBJECT:
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                         separators=_SEPARATORS)
            if c.kind is ConstraintKind.REGEX:
                return self.compiler.compile_regex(c.source)
        except (RuntimeError, ValueError) as e:
            raise ConstraintError(f"invalid {c.kind.value}: {str(e).strip().splitlines()[0][:500]}") from None
        raise ConstraintError(f"the xgrammar backend does not take {c.kind.value} constraints")

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill(self, rows: list[tuple[XGrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        self.prepare_fill(rows, bitmask)()

    def prepare_fill(self, rows: list[tuple[XGrammarMatcher, int]], bitmask: torch.Tensor):
        return partial(self.batch.batch_fill_next_token_bitmask, [m.raw for m, _ in rows], bitmask,
                       [r for _, r in rows])
