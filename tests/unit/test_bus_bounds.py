"""The codec's bounds: a size limit per message type checked before decoding, transport
parameters bounded in depth, count and decoded size, nesting past the decoder's limit refused."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest

from mesh.params import MAX_DECODED_BYTES, MAX_PARAMS, MAX_TRANSPORTS
from mesh.protocol import Cancel, DecodeError, KvSnapshot, PrefillJob, WorkerCard, decode, encode
from mesh.subjects import DEFAULT_MAX_BYTES, max_bytes


def job(transports: dict) -> PrefillJob:
    return PrefillJob("r", "m", [1, 2], "d", 0, [3], transports, 1.0, 16)


def as_wire(transports: dict) -> bytes:
    """A PrefillJob carrying ``transports`` as any sender could encode them (no local checks)."""
    raw = msgspec.msgpack.decode(encode(job({})))
    return msgspec.msgpack.encode({**raw, "transports": transports})


def test_the_transport_params_of_every_transport_round_trip():
    shm = {"name": "kv-1-w", "host": "h", "fence": "kv-1-w.fence", "gen": 7, "spec": {"num_layers": 2, "dtype": "float16"},
           "shards": [{"name": "kv-1-w", "heads": [0, 2]}, {"name": "kv-2-w", "heads": [2, 4]}]}
    nixl = {"agent": "a", "metadata": b"\x00\x01" * 512, "port": 5555, "rate": 1.5, "rdma": True,
            "addrs": [1 << 40, 2 << 40], "devices": ["mlx5_0", "mlx5_1"]}  # flat: str/int/float/bool/bytes/lists
    nats = {"subject": "mesh.m.decode.w.kv_data.r", "bytes": 1 << 20}
    transports = {"shm": shm, "nixl": nixl, "nats": nats}
    assert decode(encode(job(transports)), PrefillJob).transports == transports
    card = WorkerCard("w", "decode", "m", 16, 1, 1, "h", 1, 0.0, 0.0, transports={"nixl": nixl})
    assert decode(encode(card), WorkerCard).transports == {"nixl": nixl}


@pytest.mark.parametrize("value", [{"a": {"b": 1}}, [[1]], [{"a": [{"b": 1}]}], None, {"a": [[1]]}])
def test_params_nested_past_one_map_are_refused(value):
    with pytest.raises(DecodeError, match=r"transport parameter 'x'|Expected"):
        decode(as_wire({"shm": {"x": value}}), PrefillJob)


def test_too_many_transports_or_params_or_decoded_bytes_are_refused():
    with pytest.raises(DecodeError, match="length <= 8"):
        decode(as_wire({str(i): {} for i in range(MAX_TRANSPORTS + 1)}), PrefillJob)
    with pytest.raises(DecodeError, match=f"length <= {MAX_PARAMS}"):
        decode(as_wire({"shm": {str(i): 1 for i in range(MAX_PARAMS + 1)}}), PrefillJob)
    with pytest.raises(DecodeError, match="past"):
        decode(as_wire({"shm": {"x": [{}] * MAX_DECODED_BYTES}}), PrefillJob)
    big = {"shm": {"x": b"\0" * (4 * MAX_DECODED_BYTES)}}  # bytes cost what they weigh: no budget
    assert decode(as_wire(big), PrefillJob).transports == big
    with pytest.raises(DecodeError, match="length <= 8"):
        decode(msgspec.msgpack.encode({"type": "KvSnapshot", "worker_id": "w", "seq": 1, "snapshot_id": "s",
                                       "page": 0, "pages": 1, "blocks": {str(i): [] for i in range(9)}}), KvSnapshot)


def test_an_oversized_message_is_refused_before_decoding():
    assert max_bytes("Cancel") == DEFAULT_MAX_BYTES and max_bytes("PrefillJob") > DEFAULT_MAX_BYTES
    data = msgspec.msgpack.encode({"type": "Cancel", "request_id": "r", "junk": [{}] * DEFAULT_MAX_BYTES})
    tracemalloc.start()
    with pytest.raises(DecodeError) as e:
        decode(data, Cancel)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert e.value.reason == "oversized" and peak < len(data)  # nothing of it was decoded


def test_nesting_past_the_decoders_limit_is_a_decode_error():
    data = encode(Cancel("r"))
    deep = bytes([data[0] + 1]) + data[1:] + msgspec.msgpack.encode("x") + b"\x91" * 50_000 + b"\x01"
    with pytest.raises(DecodeError) as e:
        decode(deep, Cancel)
    assert e.value.reason == "too_deep"
