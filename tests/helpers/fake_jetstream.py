"""An in-memory stand-in for a JetStream KV bucket and object store: the calls ``BatchStore`` makes,
with the server's revision rules (``create`` only when absent, ``update(last=rev)`` only at that
revision), so the store's claim and keep-once logic is tested without a server."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, ObjectNotFoundError


@dataclass
class Entry:
    key: str
    value: bytes | None
    revision: int


class _Watcher:
    def __init__(self, entries: list[Entry]):
        self.entries = [*entries, None]

    async def updates(self, timeout: float = 5.0):
        return self.entries.pop(0)

    async def stop(self) -> None:
        pass


class FakeKV:
    def __init__(self):
        self.data: dict[str, Entry] = {}
        self.seq = 0

    def _write(self, key: str, value: bytes) -> int:
        self.seq += 1
        self.data[key] = Entry(key, value, self.seq)
        return self.seq

    async def get(self, key: str) -> Entry:
        if key not in self.data:
            raise KeyNotFoundError
        return self.data[key]

    async def put(self, key: str, value: bytes) -> int:
        return self._write(key, value)

    async def create(self, key: str, value: bytes) -> int:
        if key in self.data:
            raise KeyWrongLastSequenceError
        return self._write(key, value)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if key not in self.data or self.data[key].revision != last:
            raise KeyWrongLastSequenceError
        return self._write(key, value)

    async def purge(self, key: str) -> bool:
        self.data.pop(key, None)
        return True

    async def watch(self, pattern: str, **kwargs) -> _Watcher:
        glob = pattern.replace(">", "*")
        return _Watcher([e for k, e in sorted(self.data.items()) if fnmatch.fnmatchcase(k, glob)
                         and k.count(".") == pattern.count(".")])


class FakeJetStream:
    """``purge_stream`` of the KV bucket's stream, by subject filter."""

    def __init__(self, kv: FakeKV, bucket: str):
        self.kv, self.prefix = kv, f"$KV.{bucket}."

    async def purge_stream(self, name: str, subject: str) -> bool:
        watcher = await self.kv.watch(subject.removeprefix(self.prefix))
        while (entry := await watcher.updates()) is not None:
            await self.kv.purge(entry.key)
        return True


@dataclass
class _Object:
    data: bytes


class FakeObjects:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    async def put(self, name: str, data: bytes) -> None:
        self.data[name] = data

    async def get(self, name: str) -> _Object:
        if name not in self.data:
            raise ObjectNotFoundError
        return _Object(self.data[name])

    async def delete(self, name: str) -> None:
        if self.data.pop(name, None) is None:
            raise ObjectNotFoundError
