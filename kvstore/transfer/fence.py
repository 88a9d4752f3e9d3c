"""Write fences for senders that write straight into a decode worker's memory (``shm``).

A prefill worker copies into the decode worker's blocks itself; the decode worker cannot
stop a copy already running. So the decode worker must not reuse blocks whose job timed
out until it knows the writer has stopped, and a writer that starts late must not write.

The fence is a small file beside the KV file (``kv-{pid}-{worker}.fence`` in the mesh's
private directory): one 32-bit generation per block, and the file's bytes
``[4 b, 4 b + 4)`` as block ``b``'s lock (Linux open-file-description locks, which the
kernel drops when the process holding them exits, so a killed writer never leaves a
fence locked).

    decode  arm(blocks)      -> gen   before the job is queued: gen written to each block
    prefill lease(blocks, gen)        shared lock on every block, then every generation
                                      must still be ``gen`` (else ``Revoked``: nothing is
                                      written); the copy runs under the lock
    decode  revoke(blocks)   -> bool  exclusive lock, without waiting: taken means nobody is
                                      writing; the generations become 0 (a writer that has
                                      not started never will) and the blocks can be reused.
                                      Not taken: a copy is running; ask again later.

Clock-free: no deadline decides, only the locks and the generations.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import struct
from collections.abc import Iterator

_GEN = struct.Struct("<I")
_FLOCK = "hhqqi4x"  # struct flock on Linux x86-64/aarch64: l_type, l_whence, l_start, l_len, l_pid


class Revoked(RuntimeError):
    """The decode worker gave these blocks up (the job was too late): nothing was written."""


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids, in the order given."""
    out: list[list[int]] = []
    for b in blocks:
        if out and b == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [(a, n) for a, n in out]


def _lock(fd: int, kind: int, first: int, count: int, wait: bool) -> bool:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, first * _GEN.size, count * _GEN.size, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


def _unlock(fd: int, spans: list[tuple[int, int]]) -> None:
    for first, count in spans:
        _lock(fd, fcntl.F_UNLCK, first, count, wait=False)


def _read(fd: int, first: int, count: int) -> list[int]:
    data = os.pread(fd, count * _GEN.size, first * _GEN.size)
    return [v for (v,) in _GEN.iter_unpack(data)]


def _write(fd: int, first: int, count: int, gen: int) -> None:
    os.pwrite(fd, _GEN.pack(gen) * count, first * _GEN.size)


class FenceFile:
    """The decode worker's side: creates the file (its own, 0600) and arms and revokes blocks."""

    def __init__(self, path: str, num_blocks: int):
        self.path = path
        self.num_blocks = num_blocks
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.fd, num_blocks * _GEN.size)
        self._gens = itertools.count(1)

    def arm(self, blocks: list[int]) -> int:
        """A new generation for a job about to write ``blocks`` (none of them is being written:
        blocks under a running copy are never handed out)."""
        gen = next(self._gens) % (1 << 32) or next(self._gens)
        for first, count in runs(blocks):
            _write(self.fd, first, count, gen)
        return gen

    def revoke(self, blocks: list[int]) -> bool:
        """True: no copy into ``blocks`` is running and none can start (reuse them). False: a
        copy is running now."""
        taken: list[tuple[int, int]] = []
        try:
            for first, count in runs(blocks):
                if not _lock(self.fd, fcntl.F_WRLCK, first, count, wait=False):
                    return False
                taken.append((first, count))
            for first, count in taken:
                _write(self.fd, first, count, 0)
            return True
        finally:
            _unlock(self.fd, taken)

    def close(self, unlink: bool = True) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


@contextlib.contextmanager
def lease(fd: int, blocks: list[int], gen: int) -> Iterator[None]:
    """The prefill worker's side, around its copy (in the copying thread): hold a shared lock on
    every block and check that each still carries ``gen``; ``Revoked`` when one does not."""
    spans = runs(blocks)
    held: list[tuple[int, int]] = []
    try:
        for first, count in spans:
            _lock(fd, fcntl.F_RDLCK, first, count, wait=True)  # the decode worker holds its lock briefly
            held.append((first, count))
        for first, count in spans:
            if any(g != gen for g in _read(fd, first, count)):
                raise Revoked("the decode worker gave these blocks up (the job was too late)")
        yield
    finally:
        _unlock(fd, held)
