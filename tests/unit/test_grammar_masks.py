"""Token masks: the bitmask layout, the vectorised apply, the cache's LRU and counters, the
backend registry."""

from __future__ import annotations

import pytest
import torch

from engine.constraints import Constraint, ConstraintError
from engine.constraints.backend import bitmask_words, create_backend
from engine.constraints.cache import GrammarCache
from engine.constraints.masks import apply_bitmask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, rows", [(100, [0, 1, 2]), (70, [2, 0]), (33, [1])])
def test_apply_bitmask_matches_a_bit_by_bit_reference(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), bitmask_words(vocab)), dtype=torch.int32, generator=g)
    expected = _reference(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    untouched = [r for r in range(3) if r not in rows]
    assert all(torch.isfinite(logits[r]).all() for r in untouched)


def test_the_highest_token_ids_use_the_last_word_and_padding_bits_are_ignored():
    vocab = 40  # two words; bits 40..63 of the mask are padding
    logits = torch.zeros(1, vocab)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << (39 - 32)  # only token 39
    apply_bitmask(logits, bitmask, [0])
    assert logits[0].argmax().item() == 39 and torch.isinf(logits[0, :39]).all()


def test_the_cache_keeps_the_most_recent_and_counts():
    compiled = []
    cache = GrammarCache(lambda c: compiled.append(c.source) or c.source, capacity=2)
    a, b, c = (Constraint.regex(x) for x in "abc")
    assert cache.get(a) == "a" and cache.get(b) == "b" and cache.get(a) == "a"
    cache.get(c)  # evicts b, the least recently used
    cache.get(a)
    cache.get(b)  # compiled again
    assert compiled == ["a", "b", "c", "b"]
    s = cache.stats
    assert (s.hits, s.misses, s.evictions) == (2, 4, 2) and s.hit_rate == pytest.approx(2 / 6)
    # start_after is not part of the grammar: the same compiled grammar serves both
    assert cache.get(Constraint.regex("a", start_after=7)) == "a"


def test_unknown_and_uninstalled_backends_are_named(tiny_model):
    tok = (tiny_model / "tokenizer.json").read_text()
    with pytest.raises(ConstraintError, match="unknown grammar backend 'outlines'"):
        create_backend("outlines", tok, 4096, (2,))


def test_both_backends_allow_every_token_of_a_valid_document(tiny_model):
    """xgrammar (when installed) and llguidance, through the same Protocol: every next token of a
    valid document is allowed by the mask, and the documents' end is reached."""
    pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer

    text = (tiny_model / "tokenizer.json").read_text()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    ids = Tokenizer.from_str(text).encode('{"ok": true, "n": 42}', add_special_tokens=False).ids
    backends = [create_backend(name, text, 4096, (2,), threads=1) for name in ("llguidance", "xgrammar")]
    matchers = [b.matcher(b.compile(c)) for b in backends]
    masks = [torch.zeros(1, bitmask_words(4096), dtype=torch.int32) for _ in backends]
    for t in ids:
        for b, m, mask in zip(backends, matchers, masks, strict=True):
            b.fill([(m, 0)], mask)
        for mask in masks:
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, t
        assert all(m.consume(t) for m in matchers)
    assert matchers[0].is_done  # llguidance: the object is closed, nothing but EOS may follow


def test_llguidance_fills_the_same_masks_in_the_calling_thread_as_in_its_pool(tiny_model):
    """``threads=1`` fills matcher by matcher in the calling thread (the grammar process on a host
    with a core or two to spare), into each row's place; the pool fills the same masks."""
    from tokenizers import Tokenizer

    text = (tiny_model / "tokenizer.json").read_text()
    ids = Tokenizer.from_str(text).encode('{"name": "ab", "tags": ["x"]}', add_special_tokens=False).ids
    c = Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                                                 "tags": {"type": "array", "items": {"type": "string"}}}})
    masks = {}
    for threads in (1, 2):
        b = create_backend("llguidance", text, 4096, (2,), threads=threads)
        assert (b.executor is None) == (threads == 1)
        matchers = [b.matcher(b.compile(c)) for _ in range(4)]
        for k, m in enumerate(matchers):  # each row a few tokens further into the document
            assert all(m.consume(t) for t in ids[: 2 * k])
        mask = torch.zeros(6, bitmask_words(4096), dtype=torch.int32)
        b.fill([(m, r) for m, r in zip(matchers, (4, 0, 2, 1), strict=True)], mask)
        masks[threads] = mask
    assert torch.equal(masks[1], masks[2])
    assert (masks[1][[0, 1, 2, 4]] != 0).any(dim=1).all() and (masks[1][[3, 5]] == 0).all()
    assert len({tuple(row.tolist()) for row in masks[1][[0, 1, 2, 4]]}) == 4  # four places, four masks
