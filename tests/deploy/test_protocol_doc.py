"""docs/protocol.md says what mesh/protocol.py does: every message with every field (name, wire
type, default), every subject pattern, the codec example, the block-hash test vector and the
registry and work-queue settings. A protocol change that forgets the doc fails here."""

from __future__ import annotations

import inspect
import re
import types
import typing
from pathlib import Path

import msgspec
import pytest

from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from mesh.prefill_queue import JOB_MAX_AGE
from mesh.protocol import MESSAGE_TYPES, Cancel, Subjects, encode
from mesh.registry import DEFAULT_TTL

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def wire_type(tp) -> str:
    """The doc's name for a field's type (msgpack view of the annotation)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        inner = " \\| ".join(wire_type(a) for a in args if a is not type(None))
        return f"{inner} \\| nil" if type(None) in args else inner
    if origin is list:
        return f"list[{wire_type(typing.get_args(tp)[0])}]"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"map[{wire_type(key)}, {wire_type(value)}]"
    if tp is dict:
        return "map"
    if tp is msgspec.Raw:  # a transport parameter (mesh/params.py)
        return "param"
    return tp.__name__


def wire_default(f: msgspec.structs.FieldInfo) -> str:
    if f.required:
        return "required"
    v = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[]"
    if isinstance(v, dict):
        return "{}"
    if type(v) in MESSAGE_TYPES.values():
        return "{} (all defaults)"
    return repr(v)


MESSAGES_PART = DOC.split("\n## Messages\n", 1)[-1].split("\n## ", 1)[0]


def documented_fields(name: str) -> list[tuple[str, str, str]]:
    m = re.search(rf"^### {name}\n(.*?)(?=^#{{2,3}} |\Z)", MESSAGES_PART, re.S | re.M)
    assert m, f"docs/protocol.md has no section '### {name}'"
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.+?) \| .+ \|$", m.group(1), re.M)
    assert rows or "No\nfields." in m.group(1) or "No fields." in m.group(1), f"the section of {name} has no field table"
    return rows


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_every_field_of_every_message_is_documented(name):
    cls = MESSAGE_TYPES[name]
    hints = typing.get_type_hints(cls)
    expect = [(f.name, wire_type(hints[f.name]), wire_default(f)) for f in msgspec.structs.fields(cls)]
    assert documented_fields(name) == expect


def test_no_message_is_documented_that_does_not_exist():
    assert set(re.findall(r"^### (\w+)$", MESSAGES_PART, re.M)) == set(MESSAGE_TYPES)


PLACEHOLDERS = {"model": "MODEL", "worker": "WORKER", "request_id": "REQUESTID", "verb": "VERB", "fetch_id": "FETCHID",
                "process": "PROCESS"}


def subject_patterns() -> dict[str, str]:
    """Every subject (and JetStream name) of the table, with {placeholders}."""
    subjects = Subjects("NS")
    out = {}
    for name, fn in inspect.getmembers(subjects, inspect.ismethod):
        if name.startswith("_"):
            continue
        args = [PLACEHOLDERS[p] for p in inspect.signature(fn).parameters]
        pattern = fn(*args).replace("NS", "{ns}")
        for key, token in PLACEHOLDERS.items():
            pattern = pattern.replace(token, "{" + key + "}")
        out[name] = pattern
    return out


def test_every_subject_is_documented():
    documented = set(re.findall(r"`(\{ns\}[^`]*)`", DOC))
    patterns = subject_patterns()
    assert len(patterns) >= 15
    for name, pattern in patterns.items():
        if "*" not in pattern:
            assert pattern in documented, f"Subjects.{name}: {pattern} is not in docs/protocol.md"
            continue
        # a wildcard subscription: some documented subject must be what it matches
        tokens = pattern.split(".")
        assert any(
            len(d.split(".")) == len(tokens)
            and all(t == "*" or t == u for t, u in zip(tokens, d.split("."), strict=True))
            for d in documented
        ), f"Subjects.{name}: nothing documented matches {pattern}"
    assert "`{ns}.{model}.decode.{worker}.nccl.{verb}`" in DOC


def test_codec_example_is_the_real_encoding():
    m = re.search(r"==  ((?:[0-9a-f]{2,} ?)+)\n", DOC)
    assert m, "the codec example is missing"
    assert bytes.fromhex(m.group(1).replace(" ", "")) == encode(Cancel("r-1"))


def test_block_hash_test_vector():
    m = re.search(r'model "(\w+)", cache_scope "(\w*)", no adapter\nblock_size (\d+), tokens \[([\d, ]+)\]\n'
                  r'\s+->\s+\[([\d, ]+)\]', DOC)
    assert m, "the block-hash test vector is missing"
    model, scope, bs = m.group(1), m.group(2), int(m.group(3))
    tokens = [int(t) for t in m.group(4).split(",")]
    hashes = [int(h) for h in m.group(5).split(",")]
    assert f"public default key\n`{DEFAULT_HASH_KEY.hex()}`" in DOC
    assert block_hashes(tokens, bs, hash_seed(DEFAULT_HASH_KEY, model, scope)) == hashes


def test_registry_and_work_queue_settings_are_the_codes():
    assert f"`max_age` (TTL) {DEFAULT_TTL:g} s" in DOC
    assert f"every TTL/3 = {DEFAULT_TTL / 3:g} s" in DOC
    assert f"`max_age` {JOB_MAX_AGE:g} s" in DOC
