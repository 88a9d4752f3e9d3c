"""A worker's ranks on other hosts, the parts without a host bed: the join's answers (the group
token's proofs, the ranks a worker waits for, taken and expired ones), the door's token handshake
and hello over TCP, the lifeline across hosts (the kernel watches it; a peer that goes away is
lost, one that says goodbye is not), and the flags refused in one line. Across namespace hosts, with real
workers and the gateway: tests/integration/test_rank_hosts.py."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import pytest

from engine.parallel import lifeline, remote
from engine.parallel.lifeline import Lifeline
from engine.parallel.remote import RankHello, RemoteRanks
from engine.parallel.rendezvous import answer, group_token, invite_proof, join_proof
from engine.tiny import write_tiny_model
from kvstore.hashing import HashKey, generate_hash_key
from mesh.protocol import RankInvite, RankJoin, decode, encode

KEY = generate_hash_key()
TOKEN = group_token(KEY, "mesh", "big-1")


def ask(token: bytes, rank: int = -1, worker: str = "big-1", nonce: str = "n1") -> RankJoin:
    return RankJoin(worker, nonce, join_proof(token, worker, rank, nonce, "host-b"), rank, "host-b")


@pytest.fixture
def door():
    d = RemoteRanks("big-1", (2, 3), TOKEN, "127.0.0.1")
    yield d
    d.close()


def test_a_join_is_answered_by_its_proof_and_the_ranks_the_worker_waits_for(door, monkeypatch):
    # the token is the worker's: another mesh secret, or another worker's id, gives another one
    assert group_token(generate_hash_key(), "mesh", "big-1") != TOKEN != group_token(KEY, "mesh", "big-2")
    wrong = answer(door, TOKEN, ask(group_token(HashKey(b"\x01" * 32), "mesh", "big-1")), 1, 2)
    assert not wrong.ok and wrong.error.startswith("wrong group token")
    assert not answer(door, TOKEN, ask(TOKEN, worker="big-2"), 1, 2).ok  # a join meant for another worker
    not_invited = answer(door, TOKEN, ask(TOKEN, rank=1), 1, 2)
    assert not not_invited.ok and "waits for no rank 1" in not_invited.error
    first = answer(door, TOKEN, ask(TOKEN), 1, 4)  # any rank: the lowest it waits for
    assert first.ok and (first.rank, first.address, first.port, first.pp) == (2, "127.0.0.1", door.port, 4)
    assert first.proof == invite_proof(TOKEN, "big-1", 2, "n1", "127.0.0.1", door.port)
    assert decode(encode(first), RankInvite) == first  # one message of the bus
    assert "is taken" in answer(door, TOKEN, ask(TOKEN, rank=2, nonce="n2"), 1, 4).error
    assert answer(door, TOKEN, ask(TOKEN, nonce="n3"), 1, 4).rank == 3
    assert "has all its ranks" in answer(door, TOKEN, ask(TOKEN, nonce="n4"), 1, 4).error
    # a hold that no connection took expires: its rank is free again
    monkeypatch.setattr(remote.time, "monotonic", lambda real=time.monotonic: real() + remote.JOIN_GRACE_S + 1)
    assert answer(door, TOKEN, ask(TOKEN, rank=2, nonce="n5"), 1, 4).ok


def connect(door: RemoteRanks, token: bytes, hello) -> Connection:
    sock = socket.create_connection(("127.0.0.1", door.port), timeout=10)
    sock.settimeout(None)  # a Connection reads its descriptor blocking
    conn = Connection(sock.detach())
    answer_challenge(conn, token)
    deliver_challenge(conn, token)
    conn.send(hello)
    return conn


def test_the_door_takes_an_admitted_rank_proven_both_ways_and_refuses_others(door):
    assert door.admit(2, "nonce-2").rank == 2
    with pytest.raises(AuthenticationError):  # the wrong token fails the handshake, both ways
        connect(door, group_token(generate_hash_key(), "mesh", "big-1"), RankHello(2, "nonce-2"))
    stranger = connect(door, TOKEN, RankHello(3, "never-admitted"))
    assert stranger.poll(10) and "was not admitted" in stranger.recv()
    admitted = connect(door, TOKEN, RankHello(2, "nonce-2"))
    assert door.admit(3, "nonce-3").rank == 3
    late = connect(door, TOKEN, RankHello(3, "nonce-3"))
    links = door.wait(timeout=20)
    assert sorted(links) == [2, 3] and door.waiting_for() == []
    assert "has all its ranks" in door.admit(-1, "again").error
    links[2].send("hello rank 2")
    assert admitted.poll(10) and admitted.recv() == "hello rank 2"
    for link in links.values():
        link.close()
    late.close()
    admitted.close()


def test_the_door_gives_up_in_one_line_when_ranks_do_not_join(door):
    with pytest.raises(ValueError, match=r"rank\(s\) 2, 3 of worker big-1 did not join within 0 s"):
        door.wait(timeout=0.2)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def lost_event(link_factory):
    lost = threading.Event()
    why: list[str] = []
    link = link_factory(lambda w: (why.append(w), lost.set()))
    return link, lost, why


def test_the_kernel_watches_a_lifeline_across_hosts():
    """A host cut off acknowledges nothing: its lifeline times out after LOSS_S (the partition
    itself is tests/integration/test_rank_hosts.py's)."""
    a, b = tcp_pair()
    near = Lifeline(Connection(a.detach()), True, "rank 1")
    sock = socket.socket(fileno=near.conn.fileno())
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(lifeline.LOSS_S * 1000)
    finally:
        sock.detach()
    far = Connection(b.detach())
    far.send("a step")
    assert near.poll(5) and near.recv() == "a step"
    near.close()
    far.close()


def test_a_peer_that_goes_away_is_lost_and_one_that_says_goodbye_is_not():
    a, b = tcp_pair()
    near, near_lost, why = lost_event(lambda cb: Lifeline(Connection(a.detach()), True, "rank 1", cb))
    Connection(b.detach()).close()  # a process killed: its socket closes
    assert near_lost.wait(5) and "closed" in why[0]
    with pytest.raises(EOFError):
        near.recv()
    with pytest.raises(OSError):
        near.send("after the end")
    a, b = tcp_pair()
    near, near_lost, _ = lost_event(lambda cb: Lifeline(Connection(a.detach()), True, "worker", cb))
    far = Lifeline(Connection(b.detach()), True, "rank 1")
    assert not near_lost.wait(0.5)  # both ends alive: nothing lost
    far.send(None)  # rank 0 closes the group: goodbye, then the connection
    far.close()
    assert near.poll(5) and near.recv() is None
    assert not near_lost.wait(1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("rank-join") / "tiny", num_hidden_layers=2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--pp", "2", "--local-ranks", "1"], "--local-ranks needs --worker-id"),
    (["--pp", "2", "--local-ranks", "1", "--worker-id", "w"], "needs the mesh secret"),
    (["--pp", "2", "--local-ranks", "2", "--worker-id", "w", "--hash-key-file", "KEY"], "--local-ranks 2"),
    (["--local-ranks", "1", "--worker-id", "w", "--hash-key-file", "KEY"], "--local-ranks is for a layout of"),
    (["--pp", "2", "--rank-addr", "10.0.0.1"], "--rank-addr is for a worker with ranks on other hosts"),
    (["--pp", "2", "--local-ranks", "1", "--worker-id", "w", "--hash-key-file", "KEY", "--transports", "nats"],
     "drop --transports"),
    (["--pp", "2", "--local-ranks", "1", "--worker-id", "w", "--hash-key-file", "KEY", "--host-kv-blocks", "8"],
     "the KV tiers (--host-kv-gb) do not run with ranks on other hosts"),
    (["--model", "MOE", "--ep", "2", "--local-ranks", "1", "--worker-id", "w", "--hash-key-file", "KEY"],
     "--ep > 1 does not run with ranks on other hosts"),
])
def test_the_worker_refuses_remote_ranks_it_cannot_run_in_one_line(tiny, tmp_path, capsys, monkeypatch, argv, message):
    from cli import main

    monkeypatch.delenv("MESH_HASH_KEY", raising=False)
    (tmp_path / "key").write_text(KEY.hex())
    if "MOE" in argv:  # a later --model wins
        moe = write_tiny_model(tmp_path / "moe", "moe", num_hidden_layers=2)
        argv = [str(moe) if a == "MOE" else a for a in argv]
    argv = [str(tmp_path / "key") if a == "KEY" else a for a in argv]
    rc = main(["worker", "decode", "--model", str(tiny), "--nats", "nats://127.0.0.1:9", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_mesh_rank_refuses_to_join_without_the_mesh_secret_in_one_line(capsys, monkeypatch):
    from cli import main

    monkeypatch.delenv("MESH_HASH_KEY", raising=False)
    rc = main(["rank", "--join", "big-1", "--nats", "nats://127.0.0.1:9"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "needs the mesh secret" in err, err
