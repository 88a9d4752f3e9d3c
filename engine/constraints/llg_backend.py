"""llguidance: Earley parser over a lexer of derivative regexes, masks by walking the token trie.

Compiling a constraint builds one pristine matcher; every sequence gets a deep
copy of it (microseconds: the grammar and its lexer are shared). JSON follows
``JSON_STYLE`` (fixed separators, no free whitespace).
"""

from __future__ import annotations

from functools import partial

import llguidance as llg
import numpy as np
import torch

from mesh.constraints.spec import JSON_STYLE, Constraint, ConstraintError, ConstraintKind
from mesh.constraints.validate import first_line


class LLGuidanceMatcher:
    __slots__ = ("consume", "raw")

    def __init__(self, raw: llg.LLMatcher):
        self.raw = raw
        self.consume = raw.consume_token  # (token_id) -> bool, once per constrained row per step

    def try_consume(self, token_ids: list[int]) -> int:
        return self.raw.try_consume_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.raw.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.raw.get_error()}")

    @property
    def is_done(self) -> bool:
        return self.raw.is_stopped()

    @property
    def error(self) -> str:
        return self.raw.get_error()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int = 0):
        self.vocab_size = vocab_size
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                             eos_token=list(eos_token_ids) or None)
        except Exception as e:
            raise ConstraintError(f"llguidance cannot use this tokenizer: {e}") from None
        # one thread: the fill runs in the calling thread, matcher by matcher (no pool whose idle
        # workers keep polling for work on a core the engine thread may want)
        self.executor = llg.LLExecutor(threads or None) if threads != 1 else None

    def grammar_text(self, c: Constraint) -> str:
        """The constraint as llguidance's grammar JSON (no tokenizer needed)."""
        if c.kind is ConstraintKind.JSON_SCHEMA:
            return llg.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_STYLE)
        if c.kind is ConstraintKind.JSON_OBJECT:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if c.kind is ConstraintKind.REGEX:
            return llg.LLMatcher.grammar_from_regex(c.source)
        return llg.LLMatcher.grammar_from_lark(c.source)

    def compile(self, c: Constraint) -> llg.LLMatcher:
        try:
            grammar = self.grammar_text(c)
        except ValueError as e:
            raise ConstraintError(f"invalid {c.kind.value}: {e}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ConstraintError(f"invalid {c.kind.value}: {first_line(messages[0])}")
        pristine = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ConstraintError(f"invalid {c.kind.value}: {first_line(pristine.get_error())}")
        return pristine

    def matcher(self, compiled: llg.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def fill(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> None:
        self.prepare_fill(rows, bitmask)()

    def prepare_fill(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor | np.ndarray):
        """``bitmask``: a CPU tensor, or a numpy array (the grammar process's shared buffer)."""
        if isinstance(bitmask, np.ndarray):
            assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous
            ptr = bitmask.ctypes.data
        else:
            assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
            ptr = bitmask.data_ptr()
        words, n = bitmask.shape[1], bitmask.shape[0]
        if self.executor is None:
            fills = [partial(m.raw.unsafe_compute_mask_ptr, ptr + r * words * 4, words * 4) for m, r in rows]
            return partial(_each, fills)
        work = [(m.raw, r) for m, r in rows]
        return partial(self.executor.unsafe_compute_mask_ptr, work, ptr, words * 4, n)


def _each(calls) -> None:
    for call in calls:
        call()
