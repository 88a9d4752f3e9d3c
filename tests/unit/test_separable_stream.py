"""``mesh.tokenizer.SeparableStream``: for a WordPiece decoder, streams join each token's text
(decoded once) instead of stepping tokenizers' ``DecodeStream``; every step must give what
``DecodeStream.step`` gives, with special tokens skipped or kept, unknown ids, "##" pieces,
cleanup's contractions and punctuation, and a token that ends in U+FFFD."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from mesh.tokenizer import SeparableStream, Tokenizer

WORDS = ["<unk>", "hello", "world", "##ing", "##s", "##", "do", "not", "n't", "'s", "'m", "'ve", "'re", "'",
         ".", ",", "?", "!", "go", "bad\ufffd", "you", "a", "##\ufffd"]


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    hf.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    hf.add_tokens([AddedToken("<tool>", special=False)])
    d = tmp_path_factory.mktemp("wordpiece")
    hf.save(str(d / "tokenizer.json"))
    return Tokenizer(d)


@pytest.mark.parametrize("skip", [True, False])
def test_each_step_gives_what_decode_stream_gives(wordpiece, skip):
    tok = wordpiece
    stream = tok.decode_stream(skip)
    assert isinstance(stream, SeparableStream)
    rng = random.Random(7)
    ids = list(range(tok.vocab_size + 2))  # two ids past the vocabulary: no token
    for _ in range(1500):
        seq = [rng.choice(ids) for _ in range(rng.randrange(1, 12))]
        ours, theirs = tok.decode_stream(skip), DecodeStream(skip_special_tokens=skip)
        assert [ours(t) for t in seq] == [theirs.step(tok._tok, t) for t in seq], seq


def test_a_byte_level_tokenizer_keeps_decode_stream(tiny_model):
    assert not isinstance(Tokenizer(tiny_model).decode_stream(True), SeparableStream)
