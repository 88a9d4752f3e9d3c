"""The grammar process (engine/constraints/replica.py): its masks are the in-process fill's,
whatever the rows' order; replicas of gone sequences are dropped there; a killed process fails the
step with a clear error (and the next step starts a new one); the process exits with its engine."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineConfig
from engine.constraints import Constraint, replica
from engine.constraints.manager import GrammarConfig, GrammarManager
from engine.constraints.replica import GrammarProcessError
from engine.engine import Engine

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
]


@dataclass
class _Params:
    constraint: Constraint | None


@dataclass(eq=False)
class _Seq:
    """What the grammar manager reads of a sequence."""

    params: _Params
    generated_token_ids: list[int] = field(default_factory=list)
    grammar: object = None
    is_finished: bool = False


@pytest.fixture(scope="module")
def vocab(tiny_model) -> tuple[int, tuple[int, ...]]:
    e = Engine(EngineConfig(tiny_model, num_kv_blocks=64))
    try:
        return e.grammar.vocab_size, e.grammar.eos_token_ids
    finally:
        e.close()


def _manager(tiny_model, vocab, process: bool) -> GrammarManager:
    size, eos = vocab
    return GrammarManager(tiny_model / "tokenizer.json", size, eos, GrammarConfig(process=process))


def _masked(manager: GrammarManager, seqs: list[_Seq], vocab_size: int) -> torch.Tensor:
    """The step's masks applied to zero logits: -inf where a row may not go."""
    masks = manager.begin_step(seqs)
    logits = torch.zeros(len(seqs), vocab_size)
    if masks is not None:
        masks.apply(logits)
    return logits


def _take(seqs: list[_Seq], logits: torch.Tensor, step: int) -> None:
    """Each row takes an allowed token (not always the first: the rows spread over the grammar)."""
    for i, s in enumerate(seqs):
        allowed = torch.isfinite(logits[i]).nonzero().flatten().tolist()
        token = allowed[(7 * step + i) % len(allowed)]
        s.generated_token_ids.append(token)
        if s.grammar is not None:
            assert s.grammar.advance(token)
            s.is_finished = s.grammar.is_done


@pytest.mark.parametrize("layout", ["bias", "bitmask"])
def test_the_process_fills_the_same_masks_as_the_thread_in_any_row_order(tiny_model, vocab, layout, monkeypatch):
    if layout == "bitmask":  # what a large vocabulary gets
        monkeypatch.setattr(replica, "BIAS_MAX_VOCAB", 0)
    size = vocab[0]
    managers = {mode: _manager(tiny_model, vocab, mode) for mode in (True, False)}
    try:
        batches = {}
        for mode, m in managers.items():
            seqs = [_Seq(_Params(Constraint.json_schema(SCHEMAS[i % 2]) if i != 2 else None)) for i in range(5)]
            seqs.append(_Seq(_Params(Constraint.json_schema(SCHEMAS[0], start_after=9))))  # free until token 9
            for s in seqs:
                m.attach(s)
            batches[mode] = seqs
        for step in range(12):
            out = {}
            for mode, m in managers.items():
                seqs = batches[mode]
                live = [s for s in seqs if not s.is_finished]
                if step % 4 == 3:
                    live = live[::-1]  # another order than the one the process prepared
                out[mode] = _masked(m, live, size)
                _take(live, out[mode], step)
                if step == 1:
                    assert not live[-1].grammar.started
                    live[-1].generated_token_ids.append(9)  # the end of the thinking: the grammar starts
                    live[-1].grammar.advance(9)
                m.tokens_taken(live)
            assert torch.equal(out[True], out[False]), step
            assert torch.isinf(out[True]).any()  # the rows are constrained
        assert managers[True]._process.layout == layout
        assert [s.generated_token_ids for s in batches[True]] == [s.generated_token_ids for s in batches[False]]
        assert managers[True].stats()["mask_fill_seconds"] > 0
    finally:
        for m in managers.values():
            m.close()


def test_a_gone_sequence_is_dropped_in_the_process(tiny_model, vocab):
    m = _manager(tiny_model, vocab, True)
    try:
        seqs = [_Seq(_Params(Constraint.json_schema(SCHEMAS[0]))) for _ in range(3)]
        list(map(m.attach, seqs))
        _masked(m, seqs, vocab[0])
        assert m.stats()["process_replicas"] == 3
        del seqs[1:]
        gc.collect()
        _masked(m, seqs, vocab[0])
        assert m.stats()["process_replicas"] == 1
    finally:
        m.close()


def test_a_killed_process_fails_the_step_clearly_and_the_next_step_starts_a_new_one(tiny_model, vocab):
    m = _manager(tiny_model, vocab, True)
    try:
        seqs = [_Seq(_Params(Constraint.json_schema(SCHEMAS[1]))) for _ in range(2)]
        for s in seqs:
            m.attach(s)
        first = _masked(m, seqs, vocab[0])
        _take(seqs, first, 0)
        pid = m.process_pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(GrammarProcessError, match="exited"):  # the exit, not the fill timeout's error
            _masked(m, seqs, vocab[0])
        again = _masked(m, seqs, vocab[0])  # a new process, the replicas rebuilt from the tokens
        assert m.process_pid not in (None, pid)
        reference = _manager(tiny_model, vocab, False)
        try:
            ref_seqs = [_Seq(_Params(s.params.constraint), list(s.generated_token_ids)) for s in seqs]
            for s in ref_seqs:
                reference.attach(s)
            assert torch.equal(again, _masked(reference, ref_seqs, vocab[0]))
        finally:
            reference.close()
    finally:
        m.close()


def test_close_ends_the_process(tiny_model, vocab):
    m = _manager(tiny_model, vocab, True)
    s = _Seq(_Params(Constraint.json_object()))
    m.attach(s)
    _masked(m, [s], vocab[0])
    pid = m.process_pid
    m.close()
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_process_exits_when_the_engine_process_dies(tiny_model, vocab, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from engine.constraints import Constraint
        from engine.constraints.manager import GrammarConfig, GrammarManager
        class P:
            constraint = Constraint.json_object()
        class S:
            params, generated_token_ids, grammar, is_finished = P(), [], None, False
        m = GrammarManager({str(tiny_model / "tokenizer.json")!r}, {vocab[0]}, {vocab[1]!r}, GrammarConfig())
        s = S()
        m.attach(s)
        m.begin_step([s]).apply(torch.zeros(1, {vocab[0]}))
        print(m.process_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_replica_that_completes_or_breaks_gives_its_row_a_verdict_and_the_others_go_on(tiny_model, vocab):
    """The replicas check the tokens the engine sampled: a complete grammar and a rejected token come
    back as verdicts on those rows (their masks allow every token: the engine ends them without one),
    and the other rows' masks are the thread fill's."""
    size = vocab[0]
    managers = {mode: _manager(tiny_model, vocab, mode) for mode in (True, False)}
    try:
        seqs, out = {}, {}
        for mode, m in managers.items():
            seqs[mode] = [_Seq(_Params(Constraint.regex("a"))), _Seq(_Params(Constraint.json_schema(SCHEMAS[0]))),
                          _Seq(_Params(Constraint.json_schema(SCHEMAS[1])))]
            list(map(m.attach, seqs[mode]))
        for mode, m in managers.items():
            first = _masked(m, seqs[mode], size)
            allowed = [torch.isfinite(first[i]).nonzero().flatten().tolist() for i in range(3)]
            seqs[mode][0].generated_token_ids.append(allowed[0][0])  # "a": the grammar is complete
            seqs[mode][1].generated_token_ids.append(next(t for t in range(size) if t not in allowed[1]))  # broken
            seqs[mode][2].generated_token_ids.append(allowed[2][0])
            if mode is False:  # the thread fill: the engine's own matchers check each token
                assert [s.grammar.advance(s.generated_token_ids[-1]) for s in seqs[mode]] == [True, False, True]
            m.tokens_taken(seqs[mode])
            out[mode] = _masked(m, seqs[mode], size)
        done, broken, going = seqs[True]
        assert done.grammar.verdict and done.grammar.is_done and not done.grammar.error
        assert broken.grammar.verdict and broken.grammar.error and not broken.grammar.is_done
        assert not going.grammar.verdict
        assert torch.isfinite(out[True][:2]).all()  # every token allowed: the engine takes none of them
        assert torch.equal(out[True][2], out[False][2]) and torch.isinf(out[True][2]).any()
    finally:
        for m in managers.values():
            m.close()


def test_frames_are_read_whole_across_reads_until_the_writer_closes():
    """The framing both ends read (a 4-byte big-endian length, then the bytes), off a non-blocking
    pipe: a frame split across writes comes back whole, a deadline with none pending gives None, and
    the writer closing gives _EOF; with or without polling before it sleeps."""
    for spin in (0.0, 0.005):
        r, w = os.pipe()
        frames = replica._Frames(r, spin)
        try:
            payload = b"x" * 70_000  # more than one read
            frame = len(payload).to_bytes(4, "big") + payload
            assert frames.next(time.monotonic() + 0.02) is None
            os.write(w, frame[:3])
            assert frames.next(time.monotonic() + 0.02) is None
            for rest in (frame[3:] + frame[:10], frame[10:]):  # more than the pipe holds: written by a thread
                writer = threading.Thread(target=lambda rest=rest, w=w: (time.sleep(0.05), os.write(w, rest)))
                writer.start()
                assert frames.next(time.monotonic() + 10) == payload
                writer.join()
            os.close(w)
            w = None
            assert frames.next(time.monotonic() + 10) is replica._EOF
        finally:
            frames.close()
            if w is not None:
                os.close(w)



@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="the polling gate reads /proc/loadavg")
def test_the_process_polls_only_while_the_host_has_a_core_to_spare():
    """More runnable threads than cores, sample after sample, ends the polling (a crowd); a crowded
    sample among spare ones does not; once the host calms down it polls again."""
    r, w = os.pipe()
    frames = replica._Frames(r, 0.01)
    try:
        frames._cores = 10**6  # never crowded
        assert all(frames._spare() for _ in range(100))
        frames._cores = 0  # always crowded
        assert frames._spare()  # one sample is a blip
        assert not [frames._spare() for _ in range(30)][-1]  # a run of them is a crowd
        frames._cores = 10**6
        assert not frames._spare()  # ...that a single spare sample does not end
        assert any(frames._spare() for _ in range(100))
    finally:
        frames.close()
        os.close(w)
    r, w = os.pipe()
    quiet = replica._Frames(r)
    assert quiet._load is None  # no spin: it always sleeps, /proc is not read
    quiet.close()
    os.close(w)
