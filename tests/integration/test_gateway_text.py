"""The gateway's text handling in isolation (no processes): incremental detokenization, stop
strings, token bytes, and the OpenAI error shape of validation failures.

(These live beside the gateway's integration tests, which drive the same code end to end.)
"""

from __future__ import annotations

import random

import pytest

from gateway.errors import from_pydantic
from gateway.outputs.detok import IncrementalDetokenizer, StopMatcher, TokenTexts, text_offsets
from gateway.requests.schemas import ChatCompletionRequest, CompletionRequest
from mesh.tokenizer import Tokenizer

TEXTS = ["héllo wörld, 你好 🎉 ñandú!", "plain ascii text with spaces", "🎉🎉🎉 emoji only", "ЖЖЖ кириллица"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_emits_whole_characters_for_any_chunking(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok)
        out, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out.append(detok.push(ids[i : i + k], final=i + k >= len(ids)))
            i += k
        assert "".join(out) == text
        assert all("\ufffd" not in piece for piece in out)


def test_detokenizer_flushes_a_truly_incomplete_tail(tok):
    ids = tok.encode("ab🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == "ab"  # the emoji's last byte is missing: held back
    assert detok.flush() == "\ufffd"


def test_stop_matcher_across_feeds():
    m = StopMatcher(["a gam", "zzz"])
    out = "".join(m.feed(p) for p in ["alp", "ha b", "et", "a g", "amma delta"])
    assert (out, m.stopped) == ("alpha bet", True)
    assert m.feed("more") == "" and m.flush() == ""
    m = StopMatcher(["xyz"])
    out = "".join(m.feed(p) for p in ["abc", "dx", "y"])
    assert out == "abcd" and not m.stopped  # "xy" held back: it may start "xyz"
    assert m.flush() == "xy"
    assert StopMatcher([]).feed("anything") == "anything"


def test_token_bytes_rebuild_the_utf8_of_any_text(tok, tiny_model):
    texts = TokenTexts(tok, tiny_model)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [texts.get(t) for t in ids]
        assert b"".join(raw for _, raw in pieces) == text.encode()
        for (shown, raw), t in zip(pieces, ids, strict=True):
            if shown.startswith("bytes:"):
                assert "\ufffd" in tok.decode([t])
            else:
                assert shown == raw.decode() == tok.decode([t])
        offsets = text_offsets([raw for _, raw in pieces])
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    eos = tok.token_to_id("<|im_end|>")
    assert texts.get(eos) == ("<|im_end|>", b"<|im_end|>")


@pytest.mark.parametrize(("model", "body", "param", "contains"), [
    (CompletionRequest, '{"model": "m", "prompt": [1, [2]]}', "prompt", "invalid type or value for prompt"),
    (CompletionRequest, '{"model": "m"}', "prompt", "missing required parameter: prompt"),
    (CompletionRequest, '{"model": "m", "prompt": "x", "n": true}', "n", "invalid value for n"),
    (CompletionRequest, '[1]', None, "must be a JSON object"),
    (CompletionRequest, '{"model": "m", "prompt": "x"', None, "not valid JSON"),
    (CompletionRequest, '{"model": "m", "prompt": "x", "temperature": NaN}', "temperature", "finite"),
    (ChatCompletionRequest, '{"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
     "messages.0.content", "invalid type or value"),
    (ChatCompletionRequest, '{"model": "m", "messages": [{"role": "user"}], "top_logprobs": 1}', None,
     "top_logprobs requires logprobs"),
])
def test_validation_errors_are_openai_400s(model, body, param, contains):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        model.model_validate_json(body)
    err = from_pydantic(e.value)
    assert err.status == 400 and err.param == param and contains in err.message, err.body()
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_choice_seeds_stay_int64():
    req = CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "seed": 9223372036854775807}')
    assert req.choice_seed(0) == 2**63 - 1 and req.choice_seed(1) == -(2**63)
    assert CompletionRequest.model_validate_json('{"model": "m", "prompt": "x"}').choice_seed(3) is None
