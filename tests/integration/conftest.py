"""Fixtures of the integration tests: a nats-server on a free loopback port, and the cluster of
processes a test module starts on it (``tests.helpers.cluster``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mesh.natsserver import EmbeddedNats
from tests.helpers.cluster import Cluster


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(nats_server) -> Iterator[Cluster]:
    c = Cluster(nats_server.url)
    yield c
    c.stop()
