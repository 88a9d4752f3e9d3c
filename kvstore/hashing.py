"""The one block-hash function of pdmesh: a keyed PRF under a per-mesh secret.

Engine, kvstore, router and KV events all name a block by a chained, keyed hash.
For a seed (model, cache scope, LoRA adapter) under the mesh's secret ``HashKey``:

    k    = BLAKE2b(key=secret, person="pdmesh-blockkey", model | scope | lora)[:16]
    iv   = BLAKE2b(key=secret, person="pdmesh-blockiv",  model | scope | lora)[:16]
    c    = AES-128-CBC(k, iv, le_u32(tokens of block 0) | pad | le_u32(tokens of block 1) | pad | ...)
    s[i] = the last 16-byte ciphertext block of block i      (the chain state)
    h[i] = le_u64(s[i][:8])                                  (the block's name)

``pad`` is 0xFFFFFFFF words (never a token id) up to a multiple of 16 bytes (block sizes
that are not a multiple of 4 tokens); every block of a model has the same length (the block
size is fixed per model), so the padding is unambiguous. Because
CBC chains, ``h[i]`` names the whole prefix up to and including block ``i`` and prefix
overlap is a walk until the first miss; a growing sequence continues from ``s[i]`` (the
16-byte state, not the 64-bit name) with ``s[i]`` as the next IV. Only full blocks are
hashed.

Why this construction (issue 32):
- XXH3 is not collision-resistant: a client who knows another tenant's prompt could search
  for different tokens with the same name and poison the cache. Here each chain state is a
  CBC-MAC of the prefix under a secret key, a PRF while AES is a PRP; without the secret
  nobody can predict a name, let alone search for a collision. CBC-MAC's known weakness
  (extending a message whose tag you know) needs the tags: the chain states and names never
  leave the mesh (they travel only on the authenticated bus), a client sees at most
  ``cached_tokens`` within its own scope.
- The seed's key is derived per (model, scope, LoRA), so different tenants, cache salts and
  adapters are independent PRFs: no prefix is shared across them.
- Names are truncated to 64 bits: the birthday bound (~2^32 blocks in one scope before an
  accidental collision is likely) is far beyond any pool, and a deliberate one needs the key.
- Speed: AES-NI through ``cryptography`` hashes a 128k-token prompt in well under 2 ms
  (``python -m bench hashing``); keyed BLAKE2b per block was 3-5 ms.

Without a configured secret every process uses ``DEFAULT_HASH_KEY`` (public, so processes
still hash alike); that is unkeyed in effect and processes that serve the bus say so once.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

HASH_KEY_BYTES = 32
PAD_WORD = 0xFFFFFFFF  # no token id (ids are < the vocabulary size): a padded block is no real one
STATE_BYTES = 16  # one AES block: the chain state a growing sequence continues from
UNKEYED_WARNING = "block hashes are not keyed: set MESH_HASH_KEY or --hash-key-file"
assert array("I").itemsize == 4, "block hashing packs token ids as 32-bit unsigned ints"


@dataclass(frozen=True)
class HashKey:
    """The per-mesh secret (32 bytes). Never on the bus; repr hides it."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != HASH_KEY_BYTES:
            raise ValueError(f"a block-hash key is {HASH_KEY_BYTES} bytes, not {len(self.secret)}")

    def subkey(self, purpose: str) -> bytes:
        """A 32-byte key for another use of the mesh secret (the disk tier's checksum), domain-separated
        so that no output of one use says anything about another's."""
        return hashlib.blake2b(purpose.encode(), key=self.secret, digest_size=32, person=b"pdmesh-subkey").digest()

    @classmethod
    def from_hex(cls, text: str) -> HashKey:
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError("a block-hash key is 64 hex digits") from None
        if len(secret) != HASH_KEY_BYTES:
            raise ValueError(f"a block-hash key is {2 * HASH_KEY_BYTES} hex digits, not {2 * len(secret)}")
        return cls(secret)

    @classmethod
    def from_file(cls, path: str | Path) -> HashKey:
        """Read a key file: 64 hex digits (what ``mesh up`` writes)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the block-hash key file {path}: {e.strerror}") from None
        try:
            return cls.from_hex(text)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_HASH_KEY

    def hex(self) -> str:
        return self.secret.hex()


# Public: lets processes without a configured secret (tests, a bare worker) hash alike.
DEFAULT_HASH_KEY = HashKey(hashlib.blake2b(b"pdmesh public default block-hash key", digest_size=32).digest())


def generate_hash_key() -> HashKey:
    import secrets

    return HashKey(secrets.token_bytes(HASH_KEY_BYTES))


@dataclass(frozen=True)
class HashSeed:
    """What names one family of blocks: the AES key and IV derived for (model, scope, LoRA)."""

    aes_key: bytes = field(repr=False)
    iv: bytes = field(repr=False)
    label: str = ""  # model | scope | lora, for logs; never the secret


def _derive(key: HashKey, person: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=key.secret, person=person, digest_size=16).digest()


@lru_cache(maxsize=4096)
def hash_seed(key: HashKey, model: str, scope: str = "", lora: str | None = None) -> HashSeed:
    """The seed of ``model``'s blocks in cache ``scope`` (tenant and salt; "" for none) under LoRA
    adapter ``lora`` (None: the base model): the same in every process of a mesh."""
    label = f"{model}\x00{scope}\x00{'' if lora is None else 'lora:' + lora}"
    raw = label.encode()
    return HashSeed(_derive(key, b"pdmesh-blockkey", raw), _derive(key, b"pdmesh-blockiv", raw), label)


SMALL_BLOCKS = 64  # up to this many blocks per call, plain bytes: numpy's fixed cost is most of a few blocks


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: HashSeed,
    state: bytes | None = None,
) -> tuple[list[int], bytes | None]:
    """Names of the full blocks of ``token_ids``, continuing from chain ``state`` (None: the
    first block), and the state after the last full block (``state`` when there is none)."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return [], state
    packed = array("I", token_ids)  # 3x faster than np.asarray on a list; no slice copy
    if sys.byteorder != "little":
        packed.byteswap()
    iv = seed.iv if state is None else state
    row = 4 * block_size
    if n_full <= SMALL_BLOCKS:
        # A growing sequence names one block at a time: bytes and ints, no numpy (a few us
        # instead of ~10, and far less code to run cold between two paced steps).
        data = memoryview(packed).cast("B")[: n_full * row]
        if row % STATE_BYTES:
            pad = _PAD_BYTES[: -row % STATE_BYTES]
            data = b"".join(bytes(data[i: i + row]) + pad for i in range(0, len(data), row))
            row += len(pad)
        ct = _cbc(seed.aes_key, iv, data)
        return [int.from_bytes(ct[end - STATE_BYTES: end - 8], "little")
                for end in range(row, len(ct) + 1, row)], ct[-STATE_BYTES:]
    words = np.frombuffer(packed, dtype="<u4", count=n_full * block_size)
    if row % STATE_BYTES:
        width = -(-block_size // 4) * 4  # words per padded block
        padded = np.full((n_full, width), PAD_WORD, dtype="<u4")
        padded[:, :block_size] = words.reshape(n_full, block_size)
        words, row = padded, 4 * width
    ct = _cbc(seed.aes_key, iv, memoryview(words).cast("B"))
    lasts = np.frombuffer(ct, dtype="<u8").reshape(n_full, row // 8)[:, -2]
    return lasts.tolist(), ct[-STATE_BYTES:]


_PAD_BYTES = PAD_WORD.to_bytes(4, "little") * 3  # at most 3 words pad a block to 16 bytes
_CONTEXTS = threading.local()  # per thread: AES key -> [CBC encryptor, its chaining block]
MAX_CONTEXTS = 64  # per thread (one per seed in use: model, scope, adapter)


def _cbc(aes_key: bytes, iv: bytes, data: bytes | memoryview) -> bytes:
    """AES-128-CBC of ``data`` (whole 16-byte blocks) from ``iv``, on a context kept per thread
    and key: making one costs ~14 us, twice the encryption of a dozen blocks. A CBC context
    chains on from its last ciphertext block; encrypting ``first ^ iv ^ last`` for the first
    plaintext block makes that the same as starting from ``iv`` (``data`` is not changed)."""
    contexts = _CONTEXTS.__dict__.setdefault("by_key", {})
    ctx = contexts.get(aes_key)
    if ctx is None:
        if len(contexts) >= MAX_CONTEXTS:
            contexts.clear()
        ctx = contexts[aes_key] = [Cipher(algorithms.AES(aes_key), modes.CBC(bytes(STATE_BYTES))).encryptor(),
                                   bytes(STATE_BYTES)]
    encryptor, last = ctx
    try:
        if iv == last:
            ct = encryptor.update(data)
        else:
            first = (int.from_bytes(data[:STATE_BYTES], "little") ^ int.from_bytes(iv, "little")
                     ^ int.from_bytes(last, "little")).to_bytes(STATE_BYTES, "little")
            ct = encryptor.update(first)
            if len(data) > STATE_BYTES:
                ct += encryptor.update(data[STATE_BYTES:])
    except BaseException:
        contexts.pop(aes_key, None)  # its chaining state is unknown now
        raise
    ctx[1] = ct[-STATE_BYTES:]
    return ct


def block_hashes(token_ids: Sequence[int], block_size: int, seed: HashSeed) -> list[int]:
    """Chained names of the full blocks of ``token_ids`` (from block 0)."""
    return chain_hashes(token_ids, block_size, seed)[0]
