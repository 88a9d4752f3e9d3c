"""The mask fill in a grammar process: replica matchers, masks written into shared memory.

A thread that fills masks in the engine process costs the engine thread GIL hand-overs even when
the fill itself runs in native code (docs/benchmarks.md, "Structured output"); in another process it
costs nothing. The engine keeps its own matchers (advance, ``is_done`` and errors are decided at
once, as in-process); the grammar process keeps a replica of each one and is told, per step, which
tokens each sequence took since the last step it was sent:

    engine thread (GrammarManager)                    grammar process (serve)
    ------------------------------                    -----------------------
    prepare(c)  --- (COMPILE, kind, source) ------->  compile into its own cache
    begin_step  --- (STEP, n, rows, keys, counts,     new replicas (replaying their tokens), gone
                     tokens, new, gone, buffer) --->  ones dropped, tokens consumed, one batch fill
    forward pass                                      -> shared memory (rows of the step)
    StepMasks.wait  <-- (n, error, fill seconds) ---  (a pipe read: the GIL is free meanwhile)
    apply: one add of the bias rows (or the bitmask lookup, large vocabularies)

What the process writes (``layout``): for vocabularies up to ``BIAS_MAX_VOCAB`` the additive float
bias of every logits row of the step (0 or -inf; free rows all 0), so that applying it is one
``add_``; above it the bitmask of the constrained rows (a 128k-token bias would be 16 MB a step at
batch 32), applied by the byte-table lookup of ``masks.apply_bitmask``.

Messages are tuples of ints and strings (pickled by the C pickler; no objects). Who frees what: the
engine creates the shared buffer and unlinks it on ``close`` (the resource tracker does if the engine
dies); the grammar process only maps it. Replicas are dropped when the engine's ``GrammarState`` is
collected (its key rides on the next step) and all at once when the process exits: on ``close``,
and when the engine process dies (the pipe's EOF).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from mesh.engine.constraints.backend import bitmask_words
from mesh.engine.constraints.spec import Constraint

BIAS_MAX_VOCAB = 32_768  # up to this vocabulary the process writes float bias rows (<= 4 MB at batch 32)
COMPILE, STEP = 0, 1
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory that holds ``mesh``


class GrammarProcessError(RuntimeError):
    """The grammar process died, timed out or failed a fill: the step cannot be sampled."""


class GrammarProcess:
    """The engine's handle on its grammar process (started by the first call that needs it)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 backend: str, threads: int, cache_size: int):
        self.vocab_size = vocab_size
        self.layout = "bias" if vocab_size <= BIAS_MAX_VOCAB else "bitmask"
        # bias rows are padded to whole words (each byte of the bitmask is eight floats): the engine
        # reads the first vocab_size
        self._row_floats = bitmask_words(vocab_size) * (32 if self.layout == "bias" else 1)
        self._args = (str(tokenizer_file), vocab_size, eos_token_ids, backend, threads, cache_size, self.layout)
        self._lock = threading.Lock()  # compile messages come from other threads than the steps
        self._proc = None
        self._conn = None
        self._shm: SharedMemory | None = None
        self._rows = 0  # rows the shared buffer holds
        self.step_no = 0
        self.epoch = 0  # bumped with every process started: replicas of an older one are gone with it
        self.fill_seconds = 0.0  # in the grammar process

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> int:
        """Start the process unless it runs; its epoch (replicas of other epochs are not in it)."""
        with self._lock:
            if self._proc is None:
                self._start()
            return self.epoch

    def _start(self) -> None:
        # a fresh interpreter (not multiprocessing's spawn: it re-imports the caller's __main__, which
        # an unguarded script cannot take), on one end of a socket pair: the engine's end closing, or
        # the engine dying, is its EOF
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_SOURCE_ROOT, os.environ.get("PYTHONPATH"))))}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from mesh.engine.constraints.replica import main; main()",
             str(theirs.fileno()), json.dumps(self._args)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.epoch += 1

    def _send(self, msg: tuple) -> None:
        with self._lock:
            if self._proc is None:
                self._start()
            try:
                self._conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
            except OSError:
                self._died()

    def compile(self, c: Constraint) -> None:
        """Warm the process's cache with ``c`` (no reply; a bad constraint fails there as it did here)."""
        self._send((COMPILE, c.kind.value, c.source))

    def buffer(self, rows: int) -> tuple[np.ndarray, str | None]:
        """The shared buffer for ``rows`` rows (bias rows padded to whole words), and its name when
        the process has not mapped it yet."""
        if rows <= self._rows:
            return self._view, None
        old = self._shm
        self._rows = max(rows, 64)
        self._shm = SharedMemory(create=True, size=self._rows * self._row_floats * 4)
        dtype = np.float32 if self.layout == "bias" else np.int32
        self._view = np.ndarray((self._rows, self._row_floats), dtype, self._shm.buf)
        if old is not None:
            old.close()
            old.unlink()
        return self._view, self._shm.name

    def step(self, batch: int, rows: list[int], keys: list[int], counts: list[int], tokens: list[int],
             new: list[tuple], gone: list[int]) -> int:
        """Start the fill of one step's rows (see the module docstring); its step number."""
        n = max(batch, len(rows)) if self.layout == "bias" else len(rows)
        _, name = self.buffer(n)
        self.step_no += 1
        self._send((STEP, self.step_no, batch, rows, keys, counts, tokens, new, gone, name))
        return self.step_no

    def wait(self, step_no: int, timeout: float) -> None:
        """Block (without the GIL) until the process filled step ``step_no``."""
        conn = self._conn
        deadline = time.monotonic() + timeout
        while True:
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self._kill()
                    raise GrammarProcessError(f"the grammar process did not fill the masks in {timeout:.0f} s")
                done, error, seconds = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._died()
            if done == step_no:
                break  # earlier replies belong to steps whose masks were never applied (a failed step)
        self.fill_seconds += seconds
        if error:
            raise GrammarProcessError(f"the grammar process failed: {error}")

    def _died(self):
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._drop()
        raise GrammarProcessError(f"the grammar process exited (exit code {code}); "
                                  "the next constrained step starts a new one")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5.0)
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        if self._proc is not None:
            self._conn.close()  # the process's EOF: it exits
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)
            self._proc = self._conn = None
        if self._shm is not None:
            self._view = None
            self._shm.close()
            self._shm.unlink()
            self._shm, self._rows = None, 0


# -- the grammar process ------------------------------------------------------------------------

def main() -> None:
    """The grammar process: ``argv``: the socket's fd, the JSON of ``GrammarProcess._args``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine ends it (a Ctrl-C reaches the whole group)
    fd, args = int(sys.argv[1]), json.loads(sys.argv[2])
    args[2] = tuple(args[2])
    serve(Connection(fd), *args)


def serve(conn, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...], backend_name: str,
          threads: int, cache_size: int, layout: str) -> None:
    """The grammar process's loop: until the engine's end of the pipe closes."""
    from mesh.engine.constraints.backend import create_backend
    from mesh.engine.constraints.cache import GrammarCache
    from mesh.engine.constraints.state import GrammarState

    backend = create_backend(backend_name, Path(tokenizer_file).read_text(), vocab_size, eos_token_ids, threads)
    cache = GrammarCache(backend.compile, cache_size)
    words = bitmask_words(vocab_size)
    width = words * 32 if layout == "bias" else words
    replicas: dict[int, GrammarState] = {}
    shm = view = None
    bits = np.empty((0, words), np.int32)  # the bias layout's scratch bitmask
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine closed the pipe or died
        if msg[0] == COMPILE:
            with contextlib.suppress(Exception):  # the engine refused it already; it is cached as refused
                cache.get(Constraint(msg[1], msg[2]))
            continue
        _, step_no, batch, rows, keys, counts, tokens, new, gone, name = msg
        t0 = time.perf_counter()
        error = ""
        try:
            if name is not None:
                shm = _attach(name, shm)
                dtype = np.float32 if layout == "bias" else np.int32
                view = np.ndarray((len(shm) // (4 * width), width), dtype, shm)
            for key in gone:
                replicas.pop(key, None)
            for key, kind, source, start_after in new:
                replicas[key] = GrammarState(backend.matcher(cache.get(Constraint(kind, source))), start_after)
            work, pos = [], 0
            for j, (key, n) in enumerate(zip(keys, counts, strict=True)):
                state = replicas[key]
                if n and not state.replay(tokens[pos:pos + n]):
                    raise ValueError(f"a replica rejects the engine's tokens: {state.error}")
                pos += n
                work.append((state.matcher, j))
            if layout == "bitmask":
                backend.fill(work, view)  # rows 0..len(rows)-1: the StepMasks maps them to logits rows
            else:
                bits = _fill_bias(backend, work, rows, batch, bits, view)
        except Exception as e:  # the engine fails the step with it
            error = f"{type(e).__name__}: {e}"
        conn.send_bytes(pickle.dumps((step_no, error, time.perf_counter() - t0)))


_TABLE = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                  np.float32(0), np.float32(-np.inf))  # a byte of the bitmask -> its eight tokens' bias


def _fill_bias(backend, work: list, rows: list[int], batch: int, bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The bias rows ``out[:batch]`` of one step: -inf where the row's grammar forbids the token, 0
    elsewhere and in free rows. The bitmask goes through a scratch buffer (grown here: returned)."""
    n = len(work)
    if bits.shape[0] < n:
        bits = np.empty((max(n, 64), bits.shape[1]), np.int32)
    backend.fill(work, bits)
    per_byte = bits[:n].view(np.uint8)
    if n == batch and rows == list(range(n)):  # every row constrained (most steps): straight into place
        np.take(_TABLE, per_byte, axis=0, out=out[:n].reshape(n, -1, 8))
    else:
        out[:batch] = 0.0
        out[rows] = _TABLE[per_byte].reshape(n, -1)
    return bits


def _attach(name: str, old: mmap.mmap | None) -> mmap.mmap:
    """Map the engine's shared buffer. Not through ``SharedMemory``: on 3.11 attaching registers the
    buffer with a resource tracker of this process too (one more process, and a second unlink)."""
    if old is not None:
        old.close()
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
