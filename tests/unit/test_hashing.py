import xxhash

from kvstore.hashing import block_hashes, model_seed


def test_chained_hash_definition():
    seed = model_seed("tiny")
    toks = list(range(40))
    h = block_hashes(toks, 16, seed)
    assert len(h) == 2  # only full blocks
    b0 = b"".join(t.to_bytes(4, "little") for t in toks[:16])
    b1 = b"".join(t.to_bytes(4, "little") for t in toks[16:32])
    assert h[0] == xxhash.xxh3_64_intdigest(b0, seed=seed)
    assert h[1] == xxhash.xxh3_64_intdigest(h[0].to_bytes(8, "little") + b1, seed=seed)


def test_incremental_hashing_equals_whole():
    seed = model_seed("m")
    toks = list(range(100))
    whole = block_hashes(toks, 8, seed)
    head = block_hashes(toks[:40], 8, seed)
    tail = block_hashes(toks[40:96], 8, seed, parent=head[-1])
    assert head + tail == whole


def test_prefix_divergence_changes_all_later_hashes_and_models_differ():
    seed = model_seed("m")
    a = block_hashes(list(range(32)), 8, seed)
    b = block_hashes([*range(8), 99, *range(9, 32)], 8, seed)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert block_hashes(list(range(8)), 8, model_seed("other")) != a[:1]
