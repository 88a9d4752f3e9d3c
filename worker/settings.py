"""A worker's settings: one frozen ``WorkerSettings`` per worker process (``mesh worker`` builds it
from its flags): the lifecycle's ``CoreSettings`` (``worker.core``) and what a worker with an
engine adds (the engine, its KV transports, disaggregation, streaming), and the KV transports it
offers or uses by default."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from engine.core import EngineCore
from mesh.kvevents import INTERVAL as KV_EVENT_INTERVAL
from worker.core import CoreSettings

if TYPE_CHECKING:
    from engine.config import EngineConfig

log = logging.getLogger(__name__)

class SimulatedEngineConfig(Protocol):
    """The configuration of an engine that simulates a model (the mocker's ``MockConfig``, a layer
    above this one): it builds its own engine, which moves no KV bytes (its transport is "mock")
    and needs no warm-up. A model's ``EngineConfig`` (``simulated`` False) is built here instead:
    it cannot name ``engine.engine.Engine``, which imports it."""

    simulated: ClassVar[bool]

    def build(self) -> EngineCore: ...


@dataclass(frozen=True)
class WorkerSettings(CoreSettings):
    engine: EngineConfig | SimulatedEngineConfig | None = None  # None: a custom worker builds its own
    transports: tuple[str, ...] = ()  # () = for the device: shm,nixl,nats on CPU; cuda_ipc,nccl,nixl,nats on CUDA (nixl: if installed)
    disagg_threshold: int = 512  # decode: uncached prompt tokens from which to prefill remotely
    prefill_timeout: float = 10.0  # decode: seconds to wait for a prefill worker before prefilling locally
    prefill_capacity: int = 4  # prefill: jobs held at once
    # decode: at most one emission (TokenBatch per gateway) per this many ms; steps that end in
    # between go out together. 0: each emission as soon as the event loop is free.
    # At most one token message per gateway per interval: a step's tokens wait at most this long
    # (nothing, when steps are longer than it, as a GPU's are), and the bus carries at most
    # 1000/interval messages per second per gateway however short the steps (docs/operations.md).
    stream_interval_ms: float = 1.0
    kv_event_interval_ms: float = KV_EVENT_INTERVAL * 1000  # decode: at most one KV event batch per this many ms
    max_queued: int = 0  # decode: requests waiting for their first token beyond which new ones get 429
    # (0: 4 x max_num_seqs); the gateway then tries another worker (back-pressure)
    peer_fetch: bool = False  # decode (model): serve prefix blocks to peers, fetch what the router plans
    peer_fetch_timeout: float = 5.0  # decode: seconds a peer fetch may take before the request prefills
    peer_pin_max_s: float = 10.0  # decode: the longest a peer's fetch keeps our blocks pinned, whatever it asks
    pooling: str = "last"  # embed: the pooling of a model whose directory names none (sentence-transformers')

    @property
    def is_mock(self) -> bool:
        return getattr(self.engine, "simulated", False)

    def transport_names(self) -> list[str]:
        """The KV transports this worker offers (decode) or uses (prefill), best first."""
        from kvstore.transfer import nixl_available, ordered

        if self.is_mock:
            return ["mock"]
        on_cuda = self.engine.torch_device.type == "cuda"
        pp = getattr(self.engine, "pp", 1)
        one_tensor = [n for n in self.transports if n in ONE_TENSOR_TRANSPORTS]
        if pp > 1 and one_tensor:
            raise ValueError(f"--pp {pp} moves KV over shm or nats, not {', '.join(one_tensor)} "
                             "(a transport of one pool tensor) yet")
        names = self.transports or _default_transports(on_cuda, getattr(self.engine, "tp", 1), pp)
        if on_cuda and "shm" in names:
            raise ValueError("the shm transport is for CPU workers; on CUDA use cuda_ipc, nccl, nixl or nats")
        if "nixl" in names and not nixl_available():
            raise ValueError("the nixl transport needs NIXL: pip install 'pdmesh[nixl]'")
        if "nixl" in names and getattr(self.engine, "tp", 1) != 1:
            log.warning("the nixl transport serves TP 1 workers only: KV between hosts goes over nats")
            names = tuple(n for n in names if n != "nixl")
        return ordered(names)


_told_no_nixl = False
# They export or register the pool as one tensor: a pipeline's pool is one per stage (parts of
# layers), so a worker of --pp > 1 moves its KV over shm or nats, which copy part by part.
ONE_TENSOR_TRANSPORTS = ("cuda_ipc", "nccl", "nixl")


def _default_transports(on_cuda: bool, tp: int, pp: int = 1) -> tuple[str, ...]:
    """Same-host transports, nixl between hosts when NIXL imports (TP 1: it registers one pool
    tensor), nats as the fallback; over pipeline stages, shm on CPU and nats."""
    from kvstore.transfer import nixl_available

    global _told_no_nixl
    if pp > 1:
        return ("nats",) if on_cuda else ("shm", "nats")
    same_host = ("cuda_ipc", "nccl") if on_cuda else ("shm",)
    if tp == 1 and nixl_available():
        return (*same_host, "nixl", "nats")
    if not _told_no_nixl:
        _told_no_nixl = True
        log.info("KV between hosts goes over nats (%s)",
                 "NIXL serves TP 1 only" if tp != 1 else "NIXL is not installed: pip install 'pdmesh[nixl]'")
    return (*same_host, "nats")
