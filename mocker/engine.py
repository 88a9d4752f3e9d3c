"""``MockEngine``: ``EngineCore`` with a timing model instead of a model.

Every step is scheduled by the real scheduler over the real block pool and
prefix cache, then "executed" by sleeping for what the step would take on a
GPU (prefill cost per token, decode cost per step, per sequence and per KV
token, and the onboarding of prefix hits from the host or disk tier at that
tier's bandwidth), divided by ``speedup``. Tokens are a deterministic function
of the sequence, so outputs are reproducible. No torch: a mock worker is a
cheap process, and dozens run on two cores.

KV tiers are the real bookkeeping with no bytes: ``kvstore.tiers.HostTier`` and
``kvstore.disk.VirtualDiskTier``, so KV events, hit counters and eviction order
are what a real worker's would be. A peer fetch (``mocker.worker``) moves no
bytes either; its time comes from ``TimingModel.fetch_ms``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

from engine.core import CoreConfig, EngineCore
from engine.flags import gpu_execution_argv
from engine.scheduler import SchedulerOutput
from engine.sequence import SampledToken, Sequence
from kvstore.disk import VirtualDiskTier
from kvstore.hashing import DEFAULT_HASH_KEY, HashKey
from mesh.router import costs as ref
from mesh.router.costs import KvCosts, transfer_ms
from mocker.spec import MockDrafter, next_token, verify


@dataclass(frozen=True)
class TimingModel:
    """Milliseconds, roughly an 8B model (Llama-3-8B's KV shape) on one H100.

    Transfer rates (GB/s) and their sources are in ``mesh/router/costs.py``: pinned host
    memory over PCIe Gen4 (~25 effective), an NVMe Gen4 SSD (~5), a 100 Gb/s RDMA NIC (12.5),
    HBM3 (3,350). A block's bytes come from the model shape: 2 (K, V) x layers x KV heads x
    head dim x bytes per value x block size.
    """

    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = ref.PREFILL_MS_PER_TOKEN
    prefill_ms_per_token_ctx: float = 2e-7  # attention: grows with tokens x context
    decode_base_ms: float = ref.DECODE_STEP_MS
    decode_ms_per_seq: float = 0.06
    decode_ms_per_kv_token: float = 2e-5
    decode_ms_per_draft_token: float = 0.02  # speculative decoding: each drafted token a step verifies
    # the KV shape (Llama-3-8B: 128 KiB per token in bf16)
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_dtype_bytes: int = 2
    # where blocks come from
    host_gb_per_s: float = ref.HOST_GB_PER_S
    disk_gb_per_s: float = ref.DISK_GB_PER_S
    network_gb_per_s: float = ref.NETWORK_GB_PER_S
    fetch_base_ms: float = ref.FETCH_BASE_MS  # per peer fetch: request, pin, completion
    hbm_gb_per_s: float = 3350.0  # a holder sending from device memory takes this share of its bandwidth

    def __post_init__(self) -> None:
        if min(self.host_gb_per_s, self.disk_gb_per_s, self.network_gb_per_s, self.hbm_gb_per_s) <= 0:
            raise ValueError("transfer rates must be > 0")

    @classmethod
    def from_flags(cls, overrides: list[str]) -> TimingModel:
        """The defaults with ``--mock-timing FIELD=VALUE`` overrides (numbers only); ValueError names
        the bad one."""
        base = cls()
        types = {f.name: type(getattr(base, f.name)) for f in fields(cls)}
        over = {}
        for item in overrides:
            name, sep, value = item.partition("=")
            if not sep or name not in types:
                raise ValueError(f"--mock-timing {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(types)}")
            try:
                over[name] = types[name](value)
            except ValueError:
                raise ValueError(f"--mock-timing {item!r}: {value!r} is not a number") from None
        try:
            return replace(base, **over)
        except ValueError as e:
            raise ValueError(f"--mock-timing: {e}") from None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def prefill_tokens_per_step(self) -> int:
        """The prompt tokens whose prefill costs about one decode step (0: prefill costs nothing)."""
        if self.prefill_ms_per_token <= 0:
            return 0
        return int(self.decode_base_ms / self.prefill_ms_per_token)

    def step_ms(self, out: SchedulerOutput) -> float:
        ms = 0.0
        decodes = 0
        kv_tokens = 0
        drafted = 0
        for c in out.chunks:
            if (c.num_tokens == 1 and c.start > 0) or c.drafts:
                decodes += 1
                kv_tokens += c.end
                drafted += len(c.drafts)
            else:
                ms += (
                    self.prefill_base_ms
                    + self.prefill_ms_per_token * c.num_tokens
                    + self.prefill_ms_per_token_ctx * c.num_tokens * c.end
                )
        if decodes:
            ms += (self.decode_base_ms + self.decode_ms_per_seq * decodes + self.decode_ms_per_kv_token * kv_tokens
                   + self.decode_ms_per_draft_token * drafted)
        return ms

    def onboard_ms(self, host_blocks: int, disk_blocks: int, block_size: int) -> float:
        """Copying prefix hits from the host and disk tiers into device blocks (the step waits)."""
        block = self.block_bytes(block_size)
        return transfer_ms(host_blocks * block, self.host_gb_per_s) + transfer_ms(disk_blocks * block, self.disk_gb_per_s)

    def fetch_ms(self, tier_counts: dict[str, int], block_size: int) -> float:
        """Sending blocks to a peer: the round trips, then each block at the slower of the network
        and the tier it is read from (the holder's side; its wait for a step boundary is real time)."""
        block = self.block_bytes(block_size)
        ms = self.fetch_base_ms
        for tier, n in tier_counts.items():
            rate = min(self.network_gb_per_s, self.disk_gb_per_s) if tier == "disk" else self.network_gb_per_s
            ms += transfer_ms(n * block, rate)
        return ms

    def serve_slowdown(self) -> float:
        """A holder's steps while it sends from device memory: the NIC reads HBM alongside them."""
        return 1.0 + self.network_gb_per_s / self.hbm_gb_per_s

    def kv_costs(self, block_size: int, max_step_tokens: int) -> KvCosts:
        """What the router needs of this timing (published on the worker's card)."""
        return KvCosts.from_rates(
            block_size, kv_bytes_per_token=self.kv_bytes_per_token, prefill_ms_per_token=self.prefill_ms_per_token,
            host_gb_per_s=self.host_gb_per_s, disk_gb_per_s=self.disk_gb_per_s,
            network_gb_per_s=self.network_gb_per_s, fetch_base_ms=self.fetch_base_ms,
            decode_step_ms=self.decode_base_ms, max_step_tokens=max_step_tokens,
        )


@dataclass(frozen=True)
class MockConfig:
    """The mocker's configuration. It owns its flags (``add_args``, ``from_args``) and builds its
    engine (``build``): the worker base names no mocker (``worker.settings.SimulatedEngineConfig``)."""

    simulated: ClassVar[bool] = True  # a timing model: no KV bytes (transport "mock"), nothing to warm up
    model_name: str = "mock"
    vocab_size: int = 32000
    block_size: int = 16
    num_blocks: int = 16384
    max_model_len: int = 131072
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_with_decode: int = 0  # prompt tokens in a step that also decodes (0: no cap)
    speedup: float = 1.0
    timing: TimingModel = TimingModel()
    host_kv_blocks: int = 0  # a virtual host tier: bookkeeping and KV events, no bytes; onboarding costs time
    disk_kv_blocks: int = 0  # a virtual disk tier below it (blocks reused at least disk_min_hits times)
    disk_min_hits: int = 2
    peer_fetch: bool = False  # fetch prefix blocks from the peer a router's decision names
    fetch_timeout: float = 5.0  # seconds (wall) before a peer fetch is given up for prefill
    hint_wait: float = 0.05  # seconds (wall) to wait for the router's decision about a request
    hash_key: HashKey = DEFAULT_HASH_KEY  # the mesh's block-hash secret (the CLI's --hash-key-file)
    speculative: str | None = None  # --speculative: the method the simulated drafter reports (mocker.spec)
    num_speculative_tokens: int = 4
    spec_adaptive: bool = True  # --speculative-adaptive: K adapts per row (engine.spec.adaptive)
    spec_acceptance: float = 0.7  # the probability that each drafted token is the target's own
    # --mock-step-grid-ms: steps end on the process's grid of this period (engine.loop.InlineEngineLoop)
    step_grid_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.max_prefill_with_decode < 0:
            raise ValueError("max_prefill_with_decode must be >= 0 (0: no cap)")
        if self.host_kv_blocks < 0 or self.disk_kv_blocks < 0:
            raise ValueError("the host and disk KV tiers cannot be negative")
        if self.disk_kv_blocks and not self.host_kv_blocks:
            raise ValueError("the disk KV tier is fed by the host tier: give host KV blocks too")
        if self.fetch_timeout <= 0 or self.hint_wait < 0:
            raise ValueError("fetch_timeout must be > 0 and hint_wait >= 0")
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"--mock-spec-acceptance must be in [0, 1], got {self.spec_acceptance}")
        if self.step_grid_ms < 0:
            raise ValueError(f"--mock-step-grid-ms must be >= 0 (0: off), got {self.step_grid_ms}")
        if self.speculative and self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")

    def build(self) -> MockEngine:
        return MockEngine(self)

    @property
    def prefill_cap(self) -> int:
        """Stall-free batching in the mock's own costs. ``max_prefill_with_decode`` keeps a burst of
        admissions from stretching the running streams' next token by more than about a step; a
        model worker can only say so in tokens, but the mocker knows what a prompt token costs, so
        its cap is never below one decode step's worth of them. Where prefill costs next to nothing
        (side_by_side's matched steps: 0.001 ms a token against a 20 ms step) a cap of 512 tokens
        bought no step time and made the 256th request of a burst wait ~55 steps for its first
        token (issue 51); with the reference timing (0.06 ms a token, 8 ms a step: 133 tokens) the
        flag's 512 stands."""
        cap = self.max_prefill_with_decode
        if cap <= 0:
            return 0
        per_step = self.timing.prefill_tokens_per_step()
        return 0 if per_step == 0 else max(cap, per_step)

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        """The mocker's own flags; the rest it reads from the engine's (``engine.flags``)."""
        p.add_argument("--mock-speedup", type=float, default=1.0, help="mocker: run the timing model this much faster")
        p.add_argument("--mock-timing", action="append", default=[], metavar="FIELD=VALUE",
                       help="mocker: set a timing-model field, e.g. network_gb_per_s=50 (repeatable)")
        p.add_argument("--mock-step-grid-ms", type=float, default=0.0, metavar="MS",
                       help="mocker: each step ends on the nearest tick of this period on a grid the process's "
                            "workers share, so a process of many (--num-workers) steps them together (a step of "
                            "this period stays one; 0: off)")
        p.add_argument("--mock-spec-acceptance", type=float, default=0.7, metavar="ALPHA",
                       help="mocker with --speculative: the probability that each drafted token is accepted")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MockConfig:
        """From ``add_args`` and the engine's flags; a flag only a model worker takes is a ValueError
        of one line (ModelError: the ``--model`` it simulates)."""
        refuse_model_flags(args)
        kw = {"block_size": args.block_size, "speedup": args.mock_speedup, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_prefill_with_decode": args.max_prefill_with_decode,
              "timing": TimingModel.from_flags(args.mock_timing), "peer_fetch": getattr(args, "peer_fetch", False),
              "speculative": getattr(args, "speculative", None),
              "num_speculative_tokens": getattr(args, "num_speculative_tokens", 4),
              "spec_adaptive": getattr(args, "speculative_adaptive", True),
              "spec_acceptance": getattr(args, "mock_spec_acceptance", 0.7),
              "step_grid_ms": getattr(args, "mock_step_grid_ms", 0.0)}
        if getattr(args, "peer_fetch_timeout", None) is not None:
            kw["fetch_timeout"] = args.peer_fetch_timeout
        if args.device_kv_blocks:
            kw["num_blocks"] = args.device_kv_blocks
        if args.model:  # simulate this model: its name, vocabulary and context (the gateway brings its tokenizer)
            from engine.config import ModelConfig

            mc = ModelConfig.from_dir(args.model)
            kw.update(model_name=Path(args.model).name, vocab_size=mc.vocab_size, max_model_len=mc.max_position)
        if args.served_name:
            kw["model_name"] = args.served_name
        if args.host_kv_blocks:
            kw["host_kv_blocks"] = args.host_kv_blocks
        if args.disk_kv_blocks:
            kw["disk_kv_blocks"] = args.disk_kv_blocks
        return cls(**kw)


def refuse_model_flags(args: argparse.Namespace) -> None:
    """The engine flags only a model worker takes: each is a ValueError saying what the mocker lacks."""
    if args.host_kv_gb or args.disk_kv_dir or args.disk_kv_gb:
        raise ValueError("the mocker has no KV bytes: give its tiers in blocks (--host-kv-blocks, "
                         "--disk-kv-blocks); --host-kv-gb, --disk-kv-gb and --disk-kv-dir are for model workers")
    if args.tp != 1 or getattr(args, "pp", 1) != 1 or getattr(args, "ep", 1) != 1:
        raise ValueError("the mocker has no model to shard: --tp, --pp and --ep are for model workers")
    if args.lora or args.max_loras:
        raise ValueError("the mocker runs no model: --lora and --max-loras are for model workers")
    if gpu_execution_argv(args):
        raise ValueError("the mocker runs no model: --attention-backend, --cuda-graphs, --enforce-eager, "
                         "--async-scheduling and --fused-kernels are for model workers")


class MockEngine(EngineCore):
    def __init__(self, config: MockConfig):
        self.config = config
        super().__init__(
            CoreConfig(
                model_name=config.model_name,
                vocab_size=config.vocab_size,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_with_decode=config.prefill_cap,
                hash_key=config.hash_key,
                speculative=config.speculative,
                num_speculative_tokens=config.num_speculative_tokens,
                spec_adaptive=config.spec_adaptive,
            ),
            MockDrafter(config.speculative, config.spec_acceptance, config.vocab_size) if config.speculative else None,
        )
        if config.host_kv_blocks or config.peer_fetch:  # host_kv_blocks 0: only the stage of fetched blocks
            disk = VirtualDiskTier(config.disk_kv_blocks, self.pool.events) if config.disk_kv_blocks else None
            self.enable_tiers(config.host_kv_blocks, disk=disk, disk_min_hits=config.disk_min_hits)
        self.simulated_seconds = 0.0  # wall: the simulated time divided by the speedup
        self.simulated_ms = 0.0  # the timing model's own clock (what the GPU would have taken)
        self._onboarded = {"host": 0, "disk": 0}  # tier hit counters as of the last step

    @property
    def kv_costs(self) -> KvCosts:
        return self.config.timing.kv_costs(self.block_size, self.config.max_num_batched_tokens)

    def step_ms(self, out: SchedulerOutput) -> float:
        """The simulated time of a scheduled step: compute, plus onboarding the hits it admitted."""
        timing = self.config.timing
        ms = timing.step_ms(out)
        if self.tiers is not None:
            hits = self.tiers.hit_blocks
            host, disk = hits["host"] - self._onboarded["host"], hits["disk"] - self._onboarded["disk"]
            self._onboarded = {"host": hits["host"], "disk": hits["disk"]}
            ms += timing.onboard_ms(host, disk, self.block_size)
        if self.pins.serving_device:
            ms *= timing.serve_slowdown()
        return ms

    # Run by an InlineEngineLoop (engine.loop): steps on the event loop, and the step's pause
    # is owed to the loop (``take_owed_seconds``) instead of slept here.
    steps_inline = True
    paced = False
    owed_seconds = 0.0

    @property
    def step_grid_s(self) -> float:
        """The grid the inline loop ends steps on (0: none), in wall seconds."""
        return self.config.step_grid_ms / 1000.0 / self.config.speedup

    def take_owed_seconds(self) -> float:
        owed, self.owed_seconds = self.owed_seconds, 0.0
        return owed

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        ms = self.step_ms(out)
        self.simulated_ms += ms
        seconds = ms / 1000.0 / self.config.speedup
        self.simulated_seconds += seconds
        if self.paced:
            self.owed_seconds += seconds
        elif seconds > 0:
            time.sleep(seconds)
        return [self.token_for(c.seq, c.drafts) for c in out.chunks if c.samples]

    def token_for(self, seq: Sequence, drafts=()) -> SampledToken:
        """The next token: a fixed function of the last token and the length (``mocker.spec.next_token``;
        once per row per step: the sequence's lists read directly, not through its properties); a
        drafting row's carries the drafts it accepted and the token after them."""
        outs = seq.output_token_ids
        last = outs[-1] if outs else seq.prompt_token_ids[-1]
        length = len(seq.prompt_token_ids) + len(outs)
        if not drafts:
            return SampledToken(next_token(last, length, self.vocab_size))
        first, *then = verify(last, length, drafts, self.vocab_size)
        return SampledToken(first, None, tuple(then))
