"""A KV transport's parameters on the wire: bounded in depth, count and decoded size.

What a transport tells its peer (a buffer's name, a subject, a layout) are scalars, flat lists,
and maps of those one level deep (a KV spec; shm's per-shard files). A ``nixl`` transport's
flat parameters (str, int, float, bool, bytes, lists of ints or strings) fit as they are.

msgspec cannot type a union of ``str`` and ``bytes``, so each value arrives raw (skipped over,
not decoded) and is then decoded as a ``ParamValue`` or as ``bytes``; anything else (a map in a
map, a list of lists, nil) refuses the message. Bounds, so that a peer's bytes cost the receiver
about what they weigh: at most ``MAX_TRANSPORTS`` transports of ``MAX_PARAMS`` values each (msgspec
checks a map's length before decoding its entries), and per message at most ``MAX_DECODED_BYTES``
of values other than bytes (an empty map is one byte on the wire and ~64 in Python; bytes are
decoded as they are).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_TRANSPORTS = 8
MAX_PARAMS = 32
MAX_DECODED_BYTES = 128 << 10  # ~9 MB of Python objects at worst (empty maps in a list)

ParamLeaf = Annotated[dict[str, int | float | bool | str | list[int | str]], msgspec.Meta(max_length=MAX_PARAMS)]
ParamValue = int | float | bool | str | list[int | str | ParamLeaf] | ParamLeaf
Params = Annotated[dict[str, msgspec.Raw], msgspec.Meta(max_length=MAX_PARAMS)]  # ``ParamValue | bytes`` once checked
Transports = Annotated[dict[str, Params], msgspec.Meta(max_length=MAX_TRANSPORTS)]
_PARAM_VALUE = msgspec.msgpack.Decoder(ParamValue)
_PARAM_BYTES = msgspec.msgpack.Decoder(bytes)


def checked_transports(transports: dict[str, dict]) -> dict[str, dict]:
    """Every transport's parameters decoded in place (``checked_params``), under one budget."""
    budget = MAX_DECODED_BYTES
    for params in transports.values():
        budget = _decode_values(params, budget)
    return transports


def checked_params(params: dict) -> dict:
    """``params`` with every raw value decoded in place (values built locally are left as they
    are); ValueError for a value of another shape or past the budget."""
    _decode_values(params, MAX_DECODED_BYTES)
    return params


def _decode_values(params: dict, budget: int) -> int:
    for key, value in params.items():
        if not isinstance(value, msgspec.Raw):
            continue
        try:
            params[key] = _PARAM_BYTES.decode(value)  # bytes first: they cost what they weigh
            continue
        except msgspec.ValidationError:
            pass
        budget -= len(value)
        if budget < 0:
            raise ValueError(f"transport parameters past {MAX_DECODED_BYTES} bytes (other than bytes)")
        try:
            params[key] = _PARAM_VALUE.decode(value)
        except msgspec.ValidationError:
            raise ValueError(f"transport parameter {key!r} is not a scalar, a flat list or a flat map") from None
    return budget
