import random

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvstore.hashing import (
    DEFAULT_HASH_KEY,
    PAD_WORD,
    HashKey,
    block_hashes,
    chain_hashes,
    generate_hash_key,
    hash_seed,
)

KEY = HashKey(bytes(range(32)))


def test_keyed_chain_definition():
    """Each name is the first 8 bytes of the AES-128-CBC ciphertext block ending that token block."""
    seed = hash_seed(KEY, "tiny")
    toks = list(range(40))
    h = block_hashes(toks, 16, seed)
    assert len(h) == 2  # only full blocks
    data = b"".join(t.to_bytes(4, "little") for t in toks[:32])
    ct = Cipher(algorithms.AES(seed.aes_key), modes.CBC(seed.iv)).encryptor().update(data)
    assert h == [int.from_bytes(ct[48:56], "little"), int.from_bytes(ct[112:120], "little")]


@pytest.mark.parametrize("bs", [4, 8, 10, 16, 7])
def test_continuation_equals_one_shot(bs):
    seed = hash_seed(KEY, "m", "scope", "lora")
    toks = [random.Random(bs).randrange(200_000) for _ in range(12 * bs + 3)]
    whole = block_hashes(toks, bs, seed)
    assert len(whole) == 12
    names, state = [], None
    for cut in (0, 3 * bs, 5 * bs, 11 * bs, 12 * bs + 3):  # uneven pieces, whole blocks each
        piece = toks[len(names) * bs: cut]
        more, state = chain_hashes(piece, bs, seed, state)
        names += more
    assert names == whole


def test_padding_keeps_odd_block_sizes_apart():
    """Block size 10 pads each block to 12 words with a word no token id is: no 12-token block names the same."""
    seed = hash_seed(KEY, "m")
    assert block_hashes(list(range(1, 11)), 10, seed) != block_hashes([*range(1, 11), 0, 0], 12, seed)
    assert len(set(block_hashes(list(range(100)), 10, seed))) == 10


def test_prefix_divergence_changes_all_later_names():
    seed = hash_seed(KEY, "m")
    a = block_hashes(list(range(32)), 8, seed)
    b = block_hashes([*range(8), 99, *range(9, 32)], 8, seed)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_key_model_scope_and_lora_each_change_every_name():
    toks = list(range(64))
    seeds = [hash_seed(KEY, "m"), hash_seed(DEFAULT_HASH_KEY, "m"), hash_seed(generate_hash_key(), "m"),
             hash_seed(KEY, "other"), hash_seed(KEY, "m", "tenant-a"), hash_seed(KEY, "m", "tenant-b"),
             hash_seed(KEY, "m", lora="a"), hash_seed(KEY, "m", "tenant-a", "a")]
    names = [block_hashes(toks, 16, s) for s in seeds]
    flat = [h for n in names for h in n]
    assert len(set(flat)) == len(flat)
    assert hash_seed(KEY, "m", "tenant-a") == hash_seed(HashKey(bytes(range(32))), "m", "tenant-a")


def test_hash_key_parsing_and_secrecy(tmp_path):
    k = generate_hash_key()
    assert HashKey.from_hex(k.hex()) == k and not k.is_default and DEFAULT_HASH_KEY.is_default
    assert k.hex() not in repr(k) and k.hex() not in repr(hash_seed(k, "m"))
    f = tmp_path / "key"
    f.write_text(k.hex() + "\n")
    assert HashKey.from_file(f) == k
    for bad in ("zz", "00" * 31):
        with pytest.raises(ValueError, match="hex digits"):
            HashKey.from_hex(bad)
    with pytest.raises(ValueError, match="cannot read"):
        HashKey.from_file(tmp_path / "missing")


def test_no_full_block_keeps_the_state():
    seed = hash_seed(KEY, "m")
    _, state = chain_hashes(list(range(16)), 16, seed)
    assert chain_hashes([1, 2], 16, seed, state) == ([], state)


def test_kept_cbc_contexts_hash_as_a_fresh_cipher_would():
    """``chain_hashes`` reuses one AES-CBC context per thread and key, folding each call's IV in:
    interleaved seeds, continued chains and padded block sizes name blocks exactly as a fresh
    ``Cipher(AES(k), CBC(iv))`` over the padded words does."""
    def fresh(tokens, bs, seed, state):
        n = len(tokens) // bs
        if n == 0:
            return [], state
        words = np.array(tokens[:n * bs], dtype="<u4").reshape(n, bs)
        if (4 * bs) % 16:
            padded = np.full((n, -(-bs // 4) * 4), PAD_WORD, dtype="<u4")
            padded[:, :bs] = words
            words = padded
        ct = Cipher(algorithms.AES(seed.aes_key), modes.CBC(seed.iv if state is None else state)).encryptor()
        ct = ct.update(words.tobytes())
        return np.frombuffer(ct, dtype="<u8").reshape(n, -1)[:, -2].tolist(), ct[-16:]

    rng = random.Random(7)
    seeds = [hash_seed(HashKey(rng.randbytes(32)), "m", scope, None) for _ in range(2) for scope in ("", "t")]
    chains: dict[int, bytes] = {}
    for _ in range(400):
        i, bs = rng.randrange(len(seeds)), rng.choice([1, 3, 4, 5, 16, 17])
        tokens = [rng.randrange(50_000) for _ in range(rng.randrange(80))]
        state = chains.get(i) if rng.random() < 0.5 else None
        got = chain_hashes(tokens, bs, seeds[i], state)
        assert got == fresh(tokens, bs, seeds[i], state)
        if got[1] is not None:
            chains[i] = got[1]
