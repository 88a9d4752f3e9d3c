"""What a KV block costs a worker, in milliseconds: to prefill it, to onboard it from one of its
own lower tiers, or to fetch it from a peer.

The router weighs a cached block by what it saves: a block in a worker's host tier is worth
the prefill it spares less the onboarding it costs, not a guessed fraction of a device hit.
Costs are turned into *prefill-block units* (1.0 = the time to prefill one block), the unit of
the router's cost function. Workers publish their own figures on their card
(``WorkerCard.kv_costs``: the mocker from its timing model); a worker that publishes none is
costed as the reference below, with its own block's bytes where its card states them
(``WorkerCard.kv_block_bytes``: what its model caches per block, all layers and planes; an MLA
model's latent block is ~4.6x smaller than Llama-3-70B's, so it is cheaper to onboard and fetch).

The reference: Llama-3-8B's KV (32 layers x 8 KV heads x 128 dims, bf16 = 128 KiB per token,
2 MiB per 16-token block) on an H100-class GPU:

- prefill ~0.06 ms per token (the mocker's timing model: ~16.7k tokens/s, 2 x 8e9 FLOPs per
  token at ~27% of the H100's 989 dense bf16 TFLOP/s);
- host tier: pinned host memory over PCIe Gen4 x16, 32 GB/s raw, ~25 GB/s measured for
  large pinned ``cudaMemcpy``;
- disk tier: one NVMe Gen4 SSD, ~7 GB/s rated sequential read, ~5 GB/s through the file system;
- peer fetch: a 100 Gb/s RDMA NIC per GPU (12.5 GB/s), plus ~1 ms per fetch for its round
  trips (request, pin on the holder, completion), plus the wait for the holder's engine to
  reach a step boundary (the pool changes only between steps): half its current step;
- a decode step ~8 ms (the timing model's base).

Per 16-token block: prefill 0.96 ms; host 0.084 ms (a host-tier block is credited 0.91 of a
device hit); disk 0.42 ms (0.56); from a peer 0.17 ms (0.83) plus the fetch's fixed costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# the reference hardware (see the module docstring)
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16
PREFILL_MS_PER_TOKEN = 0.06
DECODE_STEP_MS = 8.0
HOST_GB_PER_S = 25.0
DISK_GB_PER_S = 5.0
NETWORK_GB_PER_S = 12.5
FETCH_BASE_MS = 1.0
MAX_STEP_TOKENS = 8192

# tier bits of the router's index (``mesh.router.index``)
DEVICE, HOST, DISK, PREDICTED = 1, 2, 4, 8
REAL = DEVICE | HOST | DISK  # held for sure (predicted blocks are still being computed)


def transfer_ms(num_bytes: float, gb_per_s: float) -> float:
    return num_bytes / (gb_per_s * 1e9) * 1000.0


@dataclass(frozen=True)
class KvCosts:
    """One worker's per-block costs in milliseconds (its block size)."""

    prefill_block_ms: float
    host_block_ms: float
    disk_block_ms: float
    peer_block_ms: float  # one block over the network from a peer's device or host tier
    peer_base_ms: float  # per fetch: its round trips
    decode_step_ms: float  # a holder's step when it has no prefill (the wait for a step boundary)
    max_step_blocks: float  # the most blocks one step prefills

    def __post_init__(self) -> None:
        if self.prefill_block_ms <= 0:
            raise ValueError("prefill_block_ms must be > 0")
        if min(self.host_block_ms, self.disk_block_ms, self.peer_block_ms, self.peer_base_ms,
               self.decode_step_ms, self.max_step_blocks) < 0:
            raise ValueError("KV costs cannot be negative")

    @classmethod
    def from_rates(cls, block_size: int, kv_bytes_per_token: float = KV_BYTES_PER_TOKEN,
                   prefill_ms_per_token: float = PREFILL_MS_PER_TOKEN, host_gb_per_s: float = HOST_GB_PER_S,
                   disk_gb_per_s: float = DISK_GB_PER_S, network_gb_per_s: float = NETWORK_GB_PER_S,
                   fetch_base_ms: float = FETCH_BASE_MS, decode_step_ms: float = DECODE_STEP_MS,
                   max_step_tokens: int = MAX_STEP_TOKENS) -> KvCosts:
        block = kv_bytes_per_token * block_size
        return cls(
            prefill_block_ms=prefill_ms_per_token * block_size,
            host_block_ms=transfer_ms(block, host_gb_per_s),
            disk_block_ms=transfer_ms(block, disk_gb_per_s),
            peer_block_ms=transfer_ms(block, network_gb_per_s),
            peer_base_ms=fetch_base_ms,
            decode_step_ms=decode_step_ms,
            max_step_blocks=max_step_tokens / block_size,
        )

    # -- the wire (WorkerCard.kv_costs) ---------------------------------------------------------
    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, float], block_size: int, block_bytes: int = 0) -> KvCosts:
        """A card's figures; the reference fills what it leaves out (or garbles), for blocks of
        ``block_bytes`` (the card's ``kv_block_bytes``; 0: the reference model's)."""
        base = default_costs(block_size, block_bytes)
        if not d:
            return base
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{**asdict(base), **{k: float(v) for k, v in d.items() if k in known}})
        except (TypeError, ValueError):
            return base

    # -- in prefill-block units -------------------------------------------------------------------
    def block_cost(self, bits: int) -> float:
        """A block of the worker's own prefix run, by the tiers it is in: 0 on device (or about to
        be: predicted), its onboarding below; never more than prefilling it (a tier that costs
        more than recompute is not worth reading)."""
        if bits & (DEVICE | PREDICTED):
            return 0.0
        if bits & HOST:
            return min(self.host_block_ms / self.prefill_block_ms, 1.0)
        if bits & DISK:
            return min(self.disk_block_ms / self.prefill_block_ms, 1.0)
        return 1.0

    def fetch_cost(self, num_blocks: int, num_disk: int = 0, holder_pending_blocks: float = 0.0) -> float:
        """Fetching ``num_blocks`` from a peer (``num_disk`` of them from its disk tier), whose
        engine has ``holder_pending_blocks`` still to prefill, in prefill-block units."""
        if num_blocks <= 0:
            return 0.0
        slower = max(self.disk_block_ms - self.peer_block_ms, 0.0)  # disk reads slower than the NIC
        wait = 0.5 * (self.decode_step_ms + min(holder_pending_blocks, self.max_step_blocks) * self.prefill_block_ms)
        ms = self.peer_base_ms + wait + num_blocks * self.peer_block_ms + num_disk * slower
        return ms / self.prefill_block_ms

    def credits(self) -> dict[str, float]:
        """What a cached block is worth next to a device hit (1.0), per tier: for overlap figures."""
        return {"device": 1.0, "host": 1.0 - self.block_cost(HOST), "disk": 1.0 - self.block_cost(DISK),
                "predicted": 1.0}


_DEFAULTS: dict[tuple[int, int], KvCosts] = {}


def default_costs(block_size: int = 16, block_bytes: int = 0) -> KvCosts:
    """The reference hardware's costs for ``block_size``-token blocks of ``block_bytes`` bytes
    (0: the reference model's, Llama-3-8B's K and V)."""
    key = (block_size, max(block_bytes, 0))
    c = _DEFAULTS.get(key)
    if c is None:
        per_token = key[1] / block_size if key[1] else KV_BYTES_PER_TOKEN
        c = _DEFAULTS[key] = KvCosts.from_rates(block_size, kv_bytes_per_token=per_token)
    return c
