"""The shm transport's write fence (kvstore/transfer/fence.py): a copy under way keeps its blocks
from being revoked; a revoked job's copy never starts; a killed writer never leaves it locked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvstore.transfer.fence import FenceFile, Revoked, lease, runs


@pytest.fixture
def fence(tmp_path):
    f = FenceFile(str(tmp_path / "kv-1-w.fence"), num_blocks=16)
    yield f
    f.close()


def writer_fd(fence: FenceFile) -> int:
    return os.open(fence.path, os.O_RDWR)  # another open file description, as the prefill worker's


def test_runs():
    assert runs([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
    assert runs([]) == []


def test_a_running_copy_holds_off_revoke_and_a_revoked_job_never_writes(fence):
    blocks = [2, 3, 7]
    gen = fence.arm(blocks)
    fd = writer_fd(fence)
    try:
        with lease(fd, blocks, gen):
            assert not fence.revoke(blocks)  # the copy runs: the blocks stay out of the pool
            assert not fence.revoke([7])  # any block of it
            assert fence.revoke([4, 5])  # other blocks are free to go
        assert fence.revoke(blocks)  # the copy ended
        with pytest.raises(Revoked), lease(fd, blocks, gen):
            pytest.fail("a revoked job's copy must not run")
        new = fence.arm(blocks)  # the blocks are reused by another job: its own generation
        assert new != gen
        with pytest.raises(Revoked), lease(fd, [2], gen):
            pass
        with lease(fd, blocks, new):
            pass
    finally:
        os.close(fd)


def test_revoke_waits_for_a_copy_in_another_thread(fence):
    blocks = [0, 1]
    gen = fence.arm(blocks)
    inside, release = threading.Event(), threading.Event()

    def copy():
        fd = writer_fd(fence)
        try:
            with lease(fd, blocks, gen):
                inside.set()
                release.wait(10)
        finally:
            os.close(fd)

    t = threading.Thread(target=copy)
    t.start()
    assert inside.wait(10)
    assert not fence.revoke(blocks)
    release.set()
    t.join(10)
    assert fence.revoke(blocks)


def test_a_killed_writer_releases_its_lease(fence):
    blocks = [5]
    gen = fence.arm(blocks)
    code = ("import os, sys, time; from kvstore.transfer.fence import lease\n"
            f"fd = os.open({fence.path!r}, os.O_RDWR)\n"
            f"with lease(fd, [5], {gen}):\n    print('in', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "in"
        assert not fence.revoke(blocks)
    finally:
        p.kill()
        p.wait(10)
    assert fence.revoke(blocks)
