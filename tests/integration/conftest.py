"""Fixtures of the integration tests: a nats-server on a free loopback port, and the cluster of
processes a test module starts on it (``tests.helpers.cluster``), and the bed of simulated hosts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mesh.natsserver import EmbeddedNats
from tests.helpers.cluster import Cluster
from tests.helpers.hostbed import HostBed, unavailable_reason


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(nats_server) -> Iterator[Cluster]:
    c = Cluster(nats_server.url)
    yield c
    c.stop()


@pytest.fixture
def hostbed(tmp_path) -> Iterator[HostBed]:
    """Three simulated hosts (``tests.helpers.hostbed``), each its own namespaces and nats-server of one
    cluster; everything of the bed is removed afterwards, whatever the test did. Its processes log
    to the test's ``tmp_path`` (``h<i>-<worker id>.log``)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with HostBed(3, log_dir=tmp_path) as bed:
        yield bed
