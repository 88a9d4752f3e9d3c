"""The grammar engine behind a small Protocol, and the registry of engines by name.

A backend is built once per engine from the model's ``tokenizer.json`` (the
token bytes the masks are over), the width of the model's logits (masks cover
every logit: padded vocabulary slots are never allowed) and the EOS token ids
(a finished grammar allows exactly these).

Contract:

- ``compile(constraint)`` returns an opaque compiled grammar, or raises
  ``ConstraintError`` with a message a user can act on. It may take
  milliseconds to seconds; callers cache (``GrammarCache``).
- ``matcher(compiled)`` returns a fresh ``TokenMatcher`` at the start of the
  grammar; cheap.
- ``fill(rows, bitmask)`` writes, for each ``(matcher, row)``, the allowed next
  tokens of that matcher into ``bitmask[row]`` (int32 words, bit ``t % 32`` of
  word ``t // 32`` set when token ``t`` is allowed).
- ``prepare_fill(rows, bitmask)`` does the Python part of that on the caller's
  thread and returns a no-argument callable that does the rest: the engine calls
  it from a worker thread while the model step runs, and it must release the GIL.

The default is llguidance; docs/benchmarks.md has the measurement behind that.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Protocol

import torch

from mesh.constraints.spec import Constraint, ConstraintError


class TokenMatcher(Protocol):
    def consume(self, token_id: int) -> bool:
        """Advance over one sampled token; False if the grammar does not allow it (the matcher is then
        in an error state for good)."""
        ...

    def try_consume(self, token_ids: list[int]) -> int:
        """Advance over the longest prefix of ``token_ids`` the grammar allows; its length (a
        refused token leaves the matcher as it was before it, not in an error state)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens taken (speculative decoding: drafts walked through)."""
        ...

    @property
    def is_done(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was consumed)."""
        ...

    @property
    def error(self) -> str: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int  # the width of the masks: the model's logits

    def compile(self, constraint: Constraint) -> object: ...

    def matcher(self, compiled: object) -> TokenMatcher: ...

    def fill(self, rows: list[tuple[TokenMatcher, int]], bitmask: torch.Tensor) -> None: ...

    def prepare_fill(self, rows: list[tuple[TokenMatcher, int]], bitmask: torch.Tensor) -> Callable[[], None]: ...


BACKENDS = {
    "llguidance": "engine.constraints.llg_backend:LLGuidanceBackend",
    "xgrammar": "engine.constraints.xgr_backend:XGrammarBackend",
}

# Backends whose ``fill`` also writes into numpy arrays: they can run in the grammar process
# (replica.py), which fills a shared buffer; the others fill in a thread of the engine process.
PROCESS_BACKENDS = frozenset({"llguidance"})


def create_backend(name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                   threads: int = 0) -> GrammarBackend:
    """The backend ``name`` over this tokenizer (``threads`` for the mask fill; 0: the backend's choice)."""
    target = BACKENDS.get(name)
    if target is None:
        raise ConstraintError(f"unknown grammar backend {name!r} (choose from {', '.join(BACKENDS)})")
    module, cls = target.split(":")
    try:
        backend_cls = getattr(import_module(module), cls)
    except ImportError as e:
        raise ConstraintError(f"the {name} grammar backend is not installed ({e.name})") from None
    return backend_cls(tokenizer_json, vocab_size, eos_token_ids, threads)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
