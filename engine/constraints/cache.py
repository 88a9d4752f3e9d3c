"""Compiled grammars by constraint, least recently used first out, with counters.

One per engine (so per tokenizer). Thread-safe: the engine thread reads it
when a sequence is added; a worker may warm it from another thread first, so
that a slow compile never stalls a step. A constraint that fails to compile is
remembered too (as its error), so a client repeating a bad schema costs one
compile, not one per request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mesh.constraints.spec import Constraint, ConstraintError


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    compile_seconds: float = 0.0  # total over misses

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


class GrammarCache:
    def __init__(self, compile_fn: Callable[[Constraint], object], capacity: int = 256):
        if capacity < 1:
            raise ValueError("the grammar cache needs room for at least one grammar")
        self._compile = compile_fn
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, c: Constraint) -> object:
        """The compiled grammar of ``c``; compiles it on a miss (raises ``ConstraintError``)."""
        key = c.grammar_key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                t0 = time.perf_counter()
                try:
                    entry = self._compile(c)
                except ConstraintError as e:
                    entry = e
                self.stats.compile_seconds += time.perf_counter() - t0
                self._entries[key] = entry
                if len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
                    self.stats.evictions += 1
        if isinstance(entry, ConstraintError):
            raise ConstraintError(str(entry))
        return entry
