"""nixl between pools of several ranks, in one process tree on a real nats-server: two ``--tp 2``
engines (rank 0 here, rank 1 a helper process each, with its own NIXL agent over its channel,
``kvstore.transfer.nixl_ranks``) and a pool of one rank.

- TP 2 -> TP 1, TP 2 -> TP 2 and TP 1 -> TP 2: the blocks land byte for byte in the receiving
  layout and nowhere else; each job ends with one notification per pair of ranks, and the
  carried PrefillDone comes once, after every pair's bytes.
- A long prefill (the job taken, its grant asked ahead, the write later than the receiver's fast
  polls): the writer's kick reaches the receiving helper ranks' agents too, and nothing fails.
- A sending helper rank that is gone fails the write in one clear line (no hang), and the
  receiving job stays fenced (a pair may have landed) until its writer leaves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from kvstore.cache import KVCache
from kvstore.transfer import TransferTarget, make_receiver, make_sender
from mesh.bus import Bus
from tests.helpers.cluster import wait_until
from tests.helpers.procs import alive

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

BLOCKS = 48


def filled(kv, seed: int) -> None:
    kv.write_blocks(list(range(BLOCKS)), torch.randn(kv.spec.shape, generator=torch.Generator().manual_seed(seed)))


async def test_parts_move_between_layouts_one_notification_per_pair(nats_server, tiny_model, caplog):
    bus = await Bus.connect(nats_server.url, "test-nixl-ranks", ns="nxr")
    pre = Engine(EngineConfig(tiny_model, tp=2, num_kv_blocks=BLOCKS))
    dec = Engine(EngineConfig(tiny_model, tp=2, num_kv_blocks=BLOCKS))
    one = KVCache(pre.kv_spec, torch.device("cpu"))
    try:
        filled(pre.kv_cache, 1)
        filled(one, 2)
        rx1 = make_receiver("nixl", kv=one, bus=bus, model="m", worker_id="nxr-dec1")
        rx2 = make_receiver("nixl", kv=dec.kv_cache, bus=bus, model="m", worker_id="nxr-dec2")
        await rx1.start()
        await rx2.start()
        tx = make_sender("nixl", bus=bus, worker_id="nxr-pre")
        got, now = [], {}
        for rx in (rx1, rx2):  # what the decode worker does with a carried PrefillDone: the bytes are in
            rx.on_done = lambda rid, payload: got.append(
                (rid, payload, torch.equal(now["dst"].read_blocks(now["dst_ids"]), now["src"].read_blocks(now["src_ids"]))))
        cases = [("tp2-tp1", pre.kv_cache, rx1, one), ("tp2-tp2", pre.kv_cache, rx2, dec.kv_cache),
                 ("tp1-tp2", one, rx2, dec.kv_cache)]
        for rid, src, rx, dst in cases:
            src_ids, dst_ids = [3, 4, 5, 11, 40], [7, 8, 20, 21, 2]
            before = dst.read_blocks(list(range(BLOCKS))).clone()
            now.update(src=src, dst=dst, src_ids=src_ids, dst_ids=dst_ids)
            params = rx.params(rid, dst_ids)
            assert ("parts" in params) == (rx is rx2)  # a receiver of one rank sends what it always sent
            target = TransferTarget(rid, "d", dst_ids, 16)
            tx.prepare(target, params, src)  # taken: the grant asked while the prefill computes
            await asyncio.sleep(0.2)  # a long prefill: past the receiver's fast polls, the writer kicks them
            result = await tx.send(target, params, src, src_ids, done=rid.encode())
            assert await rx.finish(rid) and rx.revoke(rid)
            after = dst.read_blocks(list(range(BLOCKS)))
            assert torch.equal(after[:, :, dst_ids], src.read_blocks(src_ids)), rid
            others = [b for b in range(BLOCKS) if b not in dst_ids]
            assert torch.equal(after[:, :, others], before[:, :, others]), rid  # nothing else written
            assert result.bytes == len(src_ids) * pre.kv_spec.block_bytes
            assert got[-1] == (rid, rid.encode(), True), got  # after every pair's bytes
            assert not rx.node.pairs  # no pair left waiting
        assert [g[0] for g in got] == [c[0] for c in cases]  # once each
        # (not another test's openai client collected here after its loop closed: same process under xdist)
        failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
                  and not (r.name == "asyncio" and "AsyncClient.aclose" in r.getMessage())]
        assert not failed, failed  # (the kick reached every rank's agent: no handler failed)

        # a sending rank that is gone: one clear error, and the receiving job stays fenced
        os.kill(pre.ranks.pids[0], signal.SIGKILL)
        await wait_until(lambda: not alive(pre.ranks.pids[0]), 10, "rank 1 gone")
        params = rx1.params("gone", [30, 31])
        with pytest.raises(RuntimeError, match="rank 1"):
            await tx.send(TransferTarget("gone", "d", [30, 31], 16), params, pre.kv_cache, [1, 2])
        assert not rx1.revoke("gone")  # granted: rank 0's pair may have landed, the other never will
        assert rx1.writer_left("nxr-pre") == 1 and rx1.revoke("gone")
    finally:
        pre.close()
        dec.close()
        one.close()
        await bus.close()
