"""The wire codec: round trips, and malformed input rejected with DecodeError."""

from __future__ import annotations

import msgpack
import pytest

from mesh.protocol import (
    DecodeError,
    GenerateRequest,
    KvChunk,
    PrefillDone,
    SamplingOptions,
    Subjects,
    TokenChunk,
    TokenLogprobs,
    Usage,
    WorkerCard,
    decode,
    encode,
    subject_token,
)


def test_round_trip_with_nested_messages():
    req = GenerateRequest("r1", "tiny", [1, 2, 3], SamplingOptions(max_tokens=5, seed=7, stop_token_ids=[2]))
    assert decode(encode(req)) == req
    chunk = TokenChunk("r1", 3, [9], [TokenLogprobs(-0.5, [9, 4], [-0.5, -1.0])], "stop", Usage(3, 1, 0))
    assert decode(encode(chunk), TokenChunk) == chunk
    done = PrefillDone("r1", "p1", True, 5, TokenLogprobs(-0.1))
    assert decode(encode(done)) == done
    kv = KvChunk("r1", 0, 0, 4, b"\x00\x01\x02\x03")
    assert decode(encode(kv)).data == b"\x00\x01\x02\x03"
    card = WorkerCard("w", "decode", "m", 16, 100, 8192, "h", 1, 0.0, 0.0, {"shm": {"path": "/dev/shm/x"}})
    assert decode(encode(card)) == card


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    raw = msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": [1], "future": 1})
    req = decode(raw, GenerateRequest)
    assert req.sampling == SamplingOptions() and req.priority == 0


@pytest.mark.parametrize("raw", [
    b"\xc1garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"no": "type"}),
    msgpack.packb({"type": "Nope"}),
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m"}),  # missing token_ids
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": "abc"}),
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": [1.5]}),
    msgpack.packb({"type": "GenerateRequest", "request_id": 5, "model": "m", "token_ids": [1]}),
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": [1],
                   "sampling": {"max_tokens": "ten"}}),
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": [1],
                   "sampling": {"temperature": True}}),
    msgpack.packb({"type": "GenerateRequest", "request_id": "a", "model": "m", "token_ids": [1], "sampling": 3}),
])
def test_malformed_input_is_a_decode_error(raw):
    with pytest.raises(DecodeError):
        decode(raw)


def test_wrong_type_is_rejected_when_expected():
    with pytest.raises(DecodeError):
        decode(encode(TokenChunk("r", 0)), GenerateRequest)


def test_subjects_sanitize_names():
    s = Subjects("mesh")
    assert s.generate("Qwen/Qwen2.5-7B", "w.1") == "mesh.Qwen_Qwen2_5-7B.decode.w_1.generate"
    assert s.prefill_jobs("tiny") == "mesh.tiny.prefill.jobs"
    assert s.workers_bucket() == "mesh_workers"
    assert subject_token("a b*c>") == "a_b_c_"
    with pytest.raises(ValueError):
        subject_token("  ")
