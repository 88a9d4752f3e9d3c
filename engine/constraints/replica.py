"""The mask fill in a grammar process: replica matchers, masks written into shared memory.

A thread that fills masks in the engine process costs the engine thread GIL hand-overs even when
the fill itself runs in native code (docs/benchmarks.md, "structured"); in another process it
costs nothing. The grammar process keeps a replica of each sequence's matcher and is told which
tokens each sequence took since it was last sent, and in which rows of which batch its masks go.
The replicas check the tokens sampled under their masks (the engine's own matchers only those it
did not sample so: state.py); a replica whose grammar is complete (or broke) gets a mask that allows
every token, and its row a verdict in the reply: the engine ends the sequence without that token.

    engine thread (GrammarManager)                   grammar process (serve)
    ------------------------------                   -----------------------
    prepare(c)    --- (COMPILE, kind, source) --->   compile into its own cache
    step N: update (tokens taken)
    tokens_taken  --- (STEP, n, batch, rows, keys,   gone replicas dropped, new ones made (replaying
                       counts, tokens, new, gone,    their tokens), tokens taken, the masks of the
                       buffer) ------------------>   replicas that moved filled (one batch call) into
    schedule step N+1                                their scratch rows, then written into shared
    begin_step: the batch tokens_taken guessed       memory in the batch's row order
      (the sequences that go on)? nothing to send;
      else (STEP, n+1, ...) with this batch -->      (only rearranges: the masks are filled)
    forward pass
    StepMasks.wait  <-- (n, seconds, replicas,   (a non-blocking read, or a select: no GIL held)
                         verdicts) -------------
    apply: one add of the bias rows (or the bitmask lookup, large vocabularies)

The fill overlaps the end of step N, the scheduling of N+1 and its forward pass. Between steps the
process polls its pipe for a while (``spin``) before it sleeps: waking a sleeping process from the
engine thread cost each message ~60 us on this 2-core machine.

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
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from engine.constraints.backend import bitmask_words, create_backend
from engine.constraints.cache import GrammarCache
from engine.constraints.state import GrammarState
from mesh.constraints.spec import Constraint

BIAS_MAX_VOCAB = 32_768  # up to this vocabulary the process writes float bias rows (<= 4 MB at batch 32)
COMPILE, STEP = 0, 1
# step number, seconds of work since the last reply, replicas alive, bytes of verdicts; then the
# verdicts (pickled: the rows whose grammar is complete or broke, with the error; most steps none),
# then an error's text
_REPLY = struct.Struct("<qdqq")
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory that holds ``mesh``


class GrammarProcessError(RuntimeError):
    """The grammar process died, timed out or failed a fill: the step cannot be sampled."""


class GrammarProcess:
    """The engine's handle on its grammar process (started by the first call that needs it)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 backend: str, threads: int, cache_size: int, spin: float = 0.0):
        self.layout = "bias" if vocab_size <= BIAS_MAX_VOCAB else "bitmask"
        # bias rows are padded to whole words (each byte of the bitmask is eight floats): the engine
        # reads the first vocab_size
        self._row_floats = bitmask_words(vocab_size) * (32 if self.layout == "bias" else 1)
        self._args = (str(tokenizer_file), vocab_size, eos_token_ids, backend, threads, cache_size, self.layout, spin)
        self._lock = threading.Lock()  # compile messages come from other threads than the steps
        self._proc = None
        self._conn = None  # a multiprocessing Connection over the pipe to the process
        self._replies: _Frames | None = None  # the pipe from it
        self._shm: SharedMemory | None = None
        self._rows = 0  # rows the shared buffer holds
        self._old: list[SharedMemory] = []
        self._mapped = 0  # the epoch of the process that mapped the current buffer
        self.step_no = 0
        self.epoch = 0  # bumped with every process started: replicas of an older one are gone with it
        self.fill_seconds = 0.0  # in the grammar process
        self.replicas = 0  # matchers alive in the process, as of its last reply

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
        # A fresh interpreter (not multiprocessing's spawn: it re-imports the caller's __main__, which
        # an unguarded script cannot take) on two pipes: the engine's write end closing, or the engine
        # dying, is its EOF. Two pipes, not a socket pair: reading a reply from a socket pair also
        # woke the process blocked on the other direction (~80 us a step on the engine thread here).
        to_child, from_engine = os.pipe()[::-1]
        from_child, to_engine = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_SOURCE_ROOT, os.environ.get("PYTHONPATH"))))}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from engine.constraints.replica import main; main()",
                 str(from_engine), str(to_engine), json.dumps(self._args)],
                pass_fds=(from_engine, to_engine), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(from_engine)
            os.close(to_engine)
        self._conn = Connection(to_child, readable=False)
        self._replies = _Frames(from_child)  # read by ``wait``: a plain read when the reply is there (most steps)
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

    @property
    def view(self) -> np.ndarray:
        """The shared buffer of the last ``step``."""
        return self._view

    def buffer(self, rows: int) -> np.ndarray:
        """The shared buffer, for at least ``rows`` rows (bias rows padded to whole words)."""
        if rows <= self._rows:
            return self._view
        old = self._shm
        self._rows = max(rows, 64)
        self._shm = SharedMemory(create=True, size=self._rows * self._row_floats * 4)
        dtype = np.float32 if self.layout == "bias" else np.int32
        self._view = np.ndarray((self._rows, self._row_floats), dtype, self._shm.buf)
        if old is not None:
            old.unlink()
            self._old.append(old)  # closed with the process: last step's tensors may still view it
        self._mapped = 0
        return self._view

    def step(self, batch: int, rows: list[int], keys: list[int], counts: list[int], tokens: list[int],
             new: list[tuple], gone: list[int]) -> int:
        """Start the fill of one step's rows (see the module docstring); its step number."""
        self.buffer(max(batch, len(rows)) if self.layout == "bias" else len(rows))
        name = None
        if self._mapped != self.epoch:  # a new buffer, or a new process: it maps the buffer first
            name, self._mapped = self._shm.name, self.epoch
        self.step_no += 1
        self._send((STEP, self.step_no, batch, rows, keys, counts, tokens, new, gone, name))
        return self.step_no

    def wait(self, step_no: int, timeout: float) -> list[tuple[int, str]]:
        """Block (without the GIL) until the process filled step ``step_no``; the verdicts of its rows:
        (row, error), error empty where the grammar is complete."""
        while True:
            reply = self._next_reply(timeout)
            done, seconds, self.replicas, n = _REPLY.unpack_from(reply)
            self.fill_seconds += seconds
            if done == step_no:
                break  # earlier replies belong to steps whose masks were never applied (a failed step)
        end = _REPLY.size + n
        if len(reply) > end:
            raise GrammarProcessError(f"the grammar process failed: {reply[end:].decode()}")
        return pickle.loads(reply[_REPLY.size:end]) if n else []

    def _next_reply(self, timeout: float) -> bytes:
        frame = self._replies.next(time.monotonic() + timeout)
        if frame is None:
            self._kill()
            raise GrammarProcessError(f"the grammar process did not fill the masks in {timeout:.0f} s")
        if frame is _EOF:
            self._died()
        return frame

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
            self._replies.close()
        self._proc = self._conn = self._replies = None

    def close(self) -> None:
        if self._proc is not None:
            self._conn.close()  # the process's EOF: it exits
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)
            self._drop()
        if self._shm is not None:
            self._shm.unlink()
            self._old.append(self._shm)
            self._shm, self._view, self._rows = None, None, 0
        for shm in self._old:
            with contextlib.suppress(BufferError):  # a tensor still views it: unmapped when collected
                shm.close()
        self._old.clear()


# -- the grammar process ------------------------------------------------------------------------

def main() -> None:
    """The grammar process: ``argv``: its two pipes' fds (in, out), the JSON of ``GrammarProcess._args``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine ends it (a Ctrl-C reaches the whole group)
    args = json.loads(sys.argv[3])
    args[2] = tuple(args[2])
    spin = args.pop()
    serve(_Frames(int(sys.argv[1]), spin), Connection(int(sys.argv[2]), readable=False), *args)
    # Nothing is left to flush or release (the engine unlinks the shared buffer): skip the
    # interpreter's teardown of numpy, llguidance and the tokenizer, ~0.4 s the engine's close waited.
    os._exit(0)


class _Replica:
    __slots__ = ("ready", "slot", "state")

    def __init__(self, state, slot: int):
        self.state = state  # a GrammarState over this process's matcher
        self.slot = slot  # its row of the mask scratch
        self.ready = False  # the scratch row is the mask after its last token


class _Replicas:
    """The grammar process's side: replica matchers by key, their masks in a scratch bitmask (one row
    each, filled as soon as a replica's token arrives), copied into the shared buffer in row order."""

    def __init__(self, backend, cache_size: int, vocab_size: int, layout: str):
        self.backend = backend
        self.cache = GrammarCache(backend.compile, cache_size)
        self.layout = layout
        self.words = bitmask_words(vocab_size)
        self.by_key: dict[int, _Replica] = {}
        self.scratch = np.zeros((64, self.words), np.int32)
        self.free = list(range(63, -1, -1))
        self.out: np.ndarray | None = None  # the shared buffer
        self._map = None

    def take(self, keys: list[int], counts: list[int], tokens: list[int], new: list, gone: list[int]) -> list[int]:
        """Drop the gone replicas, make the new ones, give each its tokens, then fill the masks of
        those that need one (one batch call). The positions in ``keys`` of the replicas whose grammar
        is complete or broke (their masks allow every token: the engine ends them without one)."""
        for key in gone:
            r = self.by_key.pop(key, None)
            if r is not None:
                self.free.append(r.slot)
        for key, kind, source, start_after in new:
            matcher = self.backend.matcher(self.cache.get(Constraint(kind, source)))
            self.by_key[key] = _Replica(GrammarState(matcher, start_after), self._slot())
        pos = 0
        work = []
        ended = []
        for j, (key, n) in enumerate(zip(keys, counts, strict=True)):
            r = self.by_key[key]
            state = r.state
            if n:
                state.replay(tokens[pos:pos + n])  # False: it broke (state.error)
                pos += n
                r.ready = False
            if state.needs_mask:
                if not r.ready:
                    work.append((state.matcher, r.slot))
                    r.ready = True
            elif state.is_done or state.error:
                ended.append(j)
                if not r.ready:
                    self.scratch[r.slot] = -1
                    r.ready = True
        if work:
            self.backend.fill(work, self.scratch)
        return ended

    def write(self, batch: int, rows: list[int], keys: list[int]) -> None:
        """The masks of ``keys`` into the shared buffer: bias rows ``[:batch]`` (free rows 0) or
        bitmask rows ``[:len(rows)]``."""
        n = len(keys)
        by_key = self.by_key
        bits = self.scratch[[by_key[k].slot for k in keys]]
        if self.layout == "bitmask":
            self.out[:n] = bits
            return
        per_byte = bits.view(np.uint8)
        if n == batch and rows == list(range(n)):  # every row constrained (most steps): straight into place
            np.take(_TABLE, per_byte, axis=0, out=self.out[:n].reshape(n, -1, 8))
        else:
            self.out[:batch] = 0.0
            self.out[rows] = _TABLE[per_byte].reshape(n, -1)

    def attach(self, name: str) -> None:
        if self._map is not None:
            self.out = None
            self._map.close()
        self._map = _attach(name)
        width = self.words * 32 if self.layout == "bias" else self.words
        dtype = np.float32 if self.layout == "bias" else np.int32
        self.out = np.ndarray((len(self._map) // (4 * width), width), dtype, self._map)

    def _slot(self) -> int:
        if not self.free:
            n = self.scratch.shape[0]
            self.scratch = np.concatenate([self.scratch, np.zeros_like(self.scratch)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()


def serve(messages: _Frames, replies: Connection, tokenizer_file: str, vocab_size: int,
          eos_token_ids: tuple[int, ...], backend_name: str, threads: int, cache_size: int, layout: str) -> None:
    """The grammar process's loop: until the engine's end of the pipe closes."""
    # the engine thread has a core of its own: the fill takes the others (on 2 cores, it runs in this thread)
    threads = threads or max(1, min(32, len(os.sched_getaffinity(0)) - 1))
    backend = create_backend(backend_name, Path(tokenizer_file).read_text(), vocab_size, eos_token_ids, threads)
    replicas = _Replicas(backend, cache_size, vocab_size, layout)
    busy = 0.0  # seconds of work since the last reply
    while True:
        frame = messages.next(None)
        if frame is _EOF:
            return  # the engine closed the pipe or died
        msg = pickle.loads(frame)
        t0 = time.perf_counter()
        kind = msg[0]
        if kind == COMPILE:
            with contextlib.suppress(Exception):  # the engine refused it already; it is cached as refused
                replicas.cache.get(Constraint(msg[1], msg[2]))
        else:
            _, step_no, batch, rows, keys, counts, tokens, new, gone, name = msg
            error = ""
            verdicts = b""
            try:
                if name is not None:
                    replicas.attach(name)
                ended = replicas.take(keys, counts, tokens, new, gone)
                replicas.write(batch, rows, keys)
                if ended:
                    verdicts = pickle.dumps([(rows[j], replicas.by_key[keys[j]].state.error) for j in ended])
            except Exception as e:  # the engine fails the step with it
                error = f"{type(e).__name__}: {e}"
            busy += time.perf_counter() - t0
            replies.send_bytes(_REPLY.pack(step_no, busy, len(replicas.by_key), len(verdicts)) + verdicts
                               + error[:2000].encode())
            busy = 0.0
            continue
        busy += time.perf_counter() - t0


_EOF = object()  # ``_Frames.next``: the writer closed its end (or died)
_LOAD_EVERY = 100e-6  # seconds between two samples of the host's runnable threads while polling


class _Frames:
    """multiprocessing's framing (a 4-byte big-endian length, then the bytes) read off a pipe set
    non-blocking: a plain read when a frame is there (Connection.poll and recv_bytes cost ~50 us a
    step more here).

    ``spin``: seconds to keep polling before sleeping in ``select``, while the host has a core to
    spare. A message to a reader asleep on another core costs its writer the wake-up (~60 us here,
    more than a short step can spare); but a poller on a crowded host takes a core from others (end
    to end through the gateway on 2 cores, constrained decoding fell from 5,780 to 5,273 tok/s;
    likely because a busy core draws no woken threads). So it polls only while the host's runnable threads (``/proc/loadavg``,
    itself included), sampled every ``_LOAD_EVERY`` and smoothed (a kernel thread's blip is not a
    crowd), mostly fit its cores, and it yields its core at every poll."""

    def __init__(self, fd: int, spin: float = 0.0):
        os.set_blocking(fd, False)
        self.fd = fd
        self.spin = spin
        self._buf = b""
        self._cores = os.cpu_count() or 1
        self._crowd = 0.0  # the smoothed share of samples with more runnable threads than cores
        self._load = None  # /proc/loadavg, kept open (a sample is a pread); none: no polling
        if spin:
            with contextlib.suppress(OSError):
                self._load = os.open("/proc/loadavg", os.O_RDONLY)

    def next(self, deadline: float | None) -> bytes | object | None:
        """The next frame; None at ``deadline`` (``time.monotonic``; None: none), ``_EOF`` at the end."""
        buf = self._buf
        sampled = time.monotonic()
        spin_until = sampled + self.spin if self._load is not None and self._spare() else 0.0
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                now = time.monotonic()
                if now < spin_until:
                    if now - sampled >= _LOAD_EVERY:
                        sampled = now
                        if not self._spare():
                            spin_until = 0.0
                    if spin_until:
                        os.sched_yield()
                        continue
                spin_until = 0.0  # the rest of this wait sleeps
                left = None if deadline is None else deadline - now
                if (left is not None and left <= 0) or not select.select([self.fd], [], [], left)[0]:
                    self._buf = buf
                    return None
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self._buf = buf
                return _EOF
            buf += chunk
        size = 4 + int.from_bytes(buf[:4], "big")
        self._buf = buf[size:]
        return buf[4:size]

    def _spare(self) -> bool:
        """Sample the runnable threads (the fourth field of /proc/loadavg, ``running/total``): does
        the host mostly have a core to spare?"""
        try:
            crowded = int(os.pread(self._load, 128, 0).split()[3].split(b"/")[0]) > self._cores
        except (OSError, IndexError, ValueError):
            crowded = True
        self._crowd += 0.05 * (crowded - self._crowd)
        return self._crowd < 0.5

    def close(self) -> None:
        os.close(self.fd)
        if self._load is not None:
            os.close(self._load)


_TABLE = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                  np.float32(0), np.float32(-np.inf))  # a byte of the bitmask -> its eight tokens' bias


def _attach(name: str) -> mmap.mmap:
    """Map the engine's shared buffer. Not through ``SharedMemory``: on 3.11 attaching registers the
    buffer with a resource tracker of this process too (one more process, and a second unlink)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
