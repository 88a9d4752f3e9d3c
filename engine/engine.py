"""The model engine: ``EngineCore`` plus a model, its paged KV cache and a sampler.

Workers run ``step()`` in a thread of their own (see ``engine.loop``);
``generate()`` runs prompts to completion in the calling thread (the CLI, tests,
benchmarks).

With several ranks (``--tp``, ``--pp``: a ``Layout``, ``engine.parallel``) this
process is rank 0: it holds its part of the model (the first stage's layers, its
share of their heads, the embeddings, the final norm and ``lm_head``) and of the
KV, and ``kv_cache`` is the whole pool over every rank's part (what the
transports move), while attention here runs on its own part only.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from pathlib import Path

import torch

from engine.attention import create_backend, default_backend
from engine.config import EngineConfig, ModelConfig
from engine.constraints.manager import GrammarConfig, GrammarManager
from engine.core import CoreConfig, EngineCore
from engine.cuda_graphs import DecodeGraphs, graph_memory_bytes
from engine.draft_model import model_drafter
from engine.eagle3_drafter import Eagle3Drafter, eagle3_drafter
from engine.inflight import StepsInFlight
from engine.kernels import Kernels
from engine.loader import load_model
from engine.lora import start_lora
from engine.mla import check_latent_support
from engine.model import ModelPart, use_kernels
from engine.moe import SparseMoE
from engine.mtp import check_mtp
from engine.mtp_drafter import MtpDrafter, mtp_drafter
from engine.overlap import OverlappedSteps
from engine.parallel.group import ParallelGroupError, RankGroup, rank_kv_spec
from engine.parallel.layout import Layout
from engine.parallel.pipeline import Pipeline
from engine.parallel.remote import RemoteRanks
from engine.parallel.stage import StageRunner, StageStats
from engine.runner import ModelRunner, PendingStep, StartedStep
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.sequence import SampledToken
from engine.state_drafter import StateDrafter
from kvstore.cache import KVCache, ShardedKVCache
from kvstore.disk import HEADER, DiskTier, layout_fingerprint, model_identity
from kvstore.tiers import BlockCopier

log = logging.getLogger(__name__)

_GIB = 1 << 30


class Engine(EngineCore):
    def __init__(self, config: EngineConfig, remote_ranks: RemoteRanks | None = None):
        """``remote_ranks``: the ranks of the layout on other hosts, which join through it (a worker
        with ``--local-ranks``; ``engine.parallel.remote``); by default every rank runs here."""
        self.config = config
        self.remote_ranks = remote_ranks
        if remote_ranks is not None and config.has_host_tier:  # the tiers copy every rank's part through rank 0
            raise ValueError("the KV tiers do not run with ranks on other hosts (rank 0 cannot reach their KV)")
        self.model_config = mc = ModelConfig.from_dir(config.model)
        mc.check_tp(config.tp, config.ep)
        mc.check_ep(config.ep)
        check_latent_support(mc, config)
        check_mtp(mc, config.speculative)  # before the weights load
        self.layout = Layout.for_model(config.tp, config.pp, mc.num_layers, config.pp_layers, config.ep)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype  # the pool's: the engine's, or FP8 (--kv-cache-dtype)
        if config.fused_kernels and self.device.type != "cuda":
            raise ValueError(f"fused kernels ({', '.join(config.fused_kernels)}) run on CUDA only, not {self.device}")
        kernels = Kernels.select(config.fused_kernels)
        max_len = min(config.max_model_len or mc.max_position, mc.max_position)
        backend = config.attention_backend or default_backend(self.device, mc.head_dim, self.dtype, mc.latent_dims,
                                                              self.kv_dtype)
        # EAGLE-3 and MTP read each step's hidden states, which decode graphs do not hand out
        reads_states = (config.speculative or "").partition(":")[0] in ("eagle3", "mtp")
        want_graphs = (config.use_cuda_graphs and self.device.type == "cuda" and self.layout.size == 1
                       and not reads_states)
        # One rank: load the weights first, so the automatic KV size sees what they took. Several:
        # rank 0 starts the other ranks first (they load their parts while it loads its own),
        # and they need the pool size to start.
        self.model = None
        if self.layout.size == 1:
            self.model = load_model(mc, self.device, self.dtype, max_positions=max_len)
        num_blocks = config.num_kv_blocks or self._auto_num_blocks(max_len, want_graphs)
        how = (config.speculative, mc, self.device, self.dtype, num_blocks, config.block_size, backend)
        drafter = model_drafter(*how) or eagle3_drafter(*how) or mtp_drafter(*how)  # None: the core's (ngram)
        super().__init__(self._core_config(num_blocks, max_len), drafter)
        self._start_ranks_and_kv(backend, num_blocks, max_len)
        if config.has_host_tier:
            self._enable_tiers()
        use_kernels(self.model, kernels)
        self.attention = create_backend(backend, self._own_kv, mc.attention_scale, mc.latent_value_dim)
        self.sampler = Sampler(self.device, config.seed, kernels, tuple(mc.eos_token_ids))
        if config.lora_slots:  # before the graphs: they capture the projections without adapter rows
            self.lora = start_lora(config, mc, self.model, self.device, self.dtype)
        self.grammar = GrammarManager(
            Path(config.model) / "tokenizer.json", mc.vocab_size, mc.eos_token_ids,
            GrammarConfig(config.grammar_backend, config.grammar_threads, config.grammar_cache_size,
                          spin_seconds=config.grammar_spin_ms / 1000),
            pin_memory=self.device.type == "cuda",
        )
        # EAGLE-3's, MTP's: fed each step's hidden states
        self.state_drafter = drafter if isinstance(drafter, StateDrafter) else None
        if self.state_drafter is not None:  # its rebuilt states' own keys and values go to a block never freed
            self.state_drafter.load(self.model, self._own_kv, self.pool.allocate(1)[0], self.lora, self.ranks)
        self._graphs = self._decode_graphs() if want_graphs else None
        self.pipeline = self._pipeline() if self.layout.pp > 1 else None
        self.runner = ModelRunner(self.model, self.attention, self.sampler, config.block_size,
                                  broadcast=self.ranks.send_step if self.ranks and not self.pipeline else None,
                                  graphs=self._graphs, lora=self.lora, grammar=self.grammar, pipeline=self.pipeline)
        self._log_ready(backend, num_blocks, kernels)

    def _pipeline(self) -> Pipeline:
        """Rank 0's side of the stages; with several steps in flight over them, ``overlap`` runs those."""
        stage = StageRunner(self.model, self.attention, self.layout, 0, self.ranks.groups, self.device, self.dtype)
        if self.config.pipeline_steps_in_flight > 1:
            self.overlap = StepsInFlight(self, self.config.pipeline_steps_in_flight)
        return Pipeline(self.ranks, stage, self.model, self.config.pipeline_microbatches)

    @property
    def tp(self) -> RankGroup | None:
        """The rank group under its former name (benchmarks read ``engine.tp.pids``)."""
        return self.ranks

    def expert_token_counts(self) -> dict[int, list[int]]:
        """MoE: (token, expert) pairs routed to each expert since start, per sparse layer (every
        token rank's under EP; under PP, the first stage's layers); {} for a dense model. One
        device read, between steps."""
        table = self.model.expert_tokens
        if table is None:
            return {}
        layers = [m.layer for m in self.model.modules() if isinstance(m, SparseMoE)]
        return dict(zip(layers, table.tolist(), strict=True))

    def stage_stats(self, reset: bool = False) -> list[StageStats]:
        """Pipeline stages: every rank's busy seconds and micro-batches since the last reset
        (rank 0's first); [] with one stage."""
        return self.pipeline.stats(reset) if self.pipeline is not None else []

    def _core_config(self, num_blocks: int, max_len: int) -> CoreConfig:
        config, mc = self.config, self.model_config
        return CoreConfig(
            model_name=config.model_name,
            vocab_size=mc.vocab_size,
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_model_len=max_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_with_decode=config.max_prefill_with_decode,
            eos_token_ids=mc.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=config.lora_slots,
            async_scheduling=config.use_async_scheduling,
            hash_key=config.hash_key,
            speculative=config.speculative,
            num_speculative_tokens=config.num_speculative_tokens,
            spec_adaptive=config.spec_adaptive,
        )

    def _start_ranks_and_kv(self, backend: str, num_blocks: int, max_len: int) -> None:
        """With several ranks, the others and this rank's part of the model; then the KV cache:
        this rank's part (``_own_kv``: the first stage's layers, its share of the heads) and the
        whole pool over every rank's (``kv_cache``)."""
        config, mc, layout = self.config, self.model_config, self.layout
        self.ranks = None
        if layout.size > 1:
            self.ranks = RankGroup(replace(config, attention_backend=backend), layout, num_blocks, max_len,
                                   _rank_kv_files(config, self.device), self.remote_ranks)
        elif self.remote_ranks is not None:
            raise ValueError("ranks on other hosts need a layout of several ranks (--tp, --pp)")
        try:
            if self.model is None:
                self.model = load_model(mc, self.device, self.dtype, max_positions=max_len, shard=self.ranks.shard,
                                        part=ModelPart(layout.layers(0)))
            own_kv = KVCache(rank_kv_spec(mc, layout, 0, num_blocks, config.block_size, self.kv_dtype), self.device,
                             shm_path=config.kv_shm_path)
            parts = self.ranks.join() if self.ranks else []  # none from ranks that hold experts only
            self.kv_cache = ShardedKVCache([own_kv, *parts], layout.tp) if parts else own_kv
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self.kv_spec = self.kv_cache.spec  # every layer, every head
        self._own_kv = own_kv

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, where the attention backend can run in them."""
        if not getattr(self.attention, "supports_cuda_graphs", False):
            return None
        # Pad rows of a graphed batch write this block; it is never freed (see cuda_graphs).
        scratch = self.pool.allocate(1)[0]
        return DecodeGraphs(self.model, self.attention, self.config.max_num_seqs, self.device, scratch,
                            self.config.block_size)

    def _log_ready(self, backend: str, num_blocks: int, kernels: Kernels) -> None:
        config, mc = self.config, self.model_config
        log.info(
            "engine ready: %s (%s) on %s %s, %d KV blocks of %d tokens (%s), attention %s%s%s%s%s",
            config.model_name, mc.family, self.device, str(self.dtype).removeprefix("torch."),
            num_blocks, config.block_size, str(self.kv_dtype).removeprefix("torch."), backend,
            f", {self.layout.size} ranks ({self.layout.describe()})" if self.ranks else "",
            ", CUDA graphs for decode" if self._graphs else "",
            f", {self.overlap.depth} steps in flight over the stages" if isinstance(self.overlap, StepsInFlight)
            else ", overlapped scheduling" if self.overlap is not None else "",
            f", fused kernels: {', '.join(sorted(kernels.names))}" if kernels.names else "",
        )

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput, prev: PendingStep | None = None) -> PendingStep:
        if self.tiers is not None:
            self.tiers.before_step()  # onboarded blocks are in place, offloaded ones read out
        try:
            pending = self.runner.launch(out, prev)
        except Exception as e:
            raise self._step_failed(e) from e
        if self.state_drafter is not None:  # rank 0's states: the residual stream is whole on every rank
            self.state_drafter.capture(out.chunks, self.model.aux_hidden)
            self.model.aux_hidden = None  # a long prefill's states are not kept past the step
        return pending

    def _step_failed(self, e: Exception) -> Exception:
        """What a failed step raises: over several ranks, which may be out of step now, the group
        is closed (it can never step again)."""
        if self.ranks is None:
            return e
        self.ranks.abort(f"{type(e).__name__}: {e}")
        return ParallelGroupError(f"a step over the ranks failed: {type(e).__name__}: {e}")

    # -- steps in flight over pipeline stages (engine.inflight) -------------------------
    def start(self, out: SchedulerOutput) -> _Started:
        """Rank 0's stage of the step; its later stages go on while this thread schedules the
        next. A decode step is one micro-batch (the steps in flight keep the stages busy), a step
        with prompt chunks is cut into micro-batches as usual."""
        if self.tiers is not None:
            self.tiers.before_step()
        prompts = any(c.num_tokens > 1 and not c.drafts for c in out.chunks)
        try:
            return _Started(self.runner.start(out, None if prompts else 1), self._step_failed)
        except Exception as e:
            raise self._step_failed(e) from e

    def abort(self, request_id: str):
        steps = self.steps_in_flight
        seq = self.scheduler.find(request_id) if steps is not None else None
        if seq is not None:
            steps.fence(seq)  # its blocks wait for its step in flight
        return super().abort(request_id)

    def runs_whole(self, seqs) -> bool:
        """Whether a step of ``seqs`` runs alone, as one step at a time would: one with constrained
        rows (their masks are one step's at a time), or every step while the runner keeps each
        step's logits."""
        return self.runner.capture_logits or any(s.grammar is not None for s in seqs)

    @property
    def steps_in_flight(self) -> StepsInFlight | None:
        """The steps in flight over the stages, if this engine keeps several (``engine.inflight``)."""
        return self.overlap if isinstance(self.overlap, StepsInFlight) else None

    def set_execution(self, *, cuda_graphs: bool | None = None, async_scheduling: bool | None = None,
                      fused_kernels: tuple[str, ...] | None = None, attention_backend: str | None = None) -> None:
        """Switch how this engine runs its steps (None: leave as is). For benchmarks that compare
        execution modes on one copy of the weights; the engine must be idle. Graphs can only be
        switched back on in an engine built with them; a change of kernels or attention backend
        recaptures them."""
        if self.has_work:
            raise RuntimeError("set_execution on an engine with requests in it")
        if self.ranks is not None:
            raise ValueError("set_execution is not supported with several ranks (--tp, --pp > 1)")
        graphs = self._graphs
        if cuda_graphs and graphs is None:
            raise ValueError("this engine was built without CUDA graphs (cuda_graphs=True, on CUDA)")
        if attention_backend is not None and attention_backend != self.attention.name:
            mc = self.model_config
            self.attention = create_backend(attention_backend, self._own_kv, mc.attention_scale, mc.latent_value_dim)
            self.runner = ModelRunner(self.model, self.attention, self.sampler, self.block_size,
                                      graphs=self.runner.graphs)
            if graphs is not None:
                if not getattr(self.attention, "supports_cuda_graphs", False):
                    raise ValueError(f"attention {attention_backend!r} cannot run in CUDA graphs")
                graphs.attention = self.attention
                graphs.graphs.clear()
        if fused_kernels is not None:
            if fused_kernels and self.device.type != "cuda":
                raise ValueError(f"fused kernels run on CUDA only, not {self.device}")
            kernels = Kernels.select(fused_kernels)
            use_kernels(self.model, kernels)
            self.sampler.kernels = kernels
            if graphs is not None:
                graphs.graphs.clear()  # captured with the other kernels
        if cuda_graphs is not None:
            self.runner.graphs = graphs if cuda_graphs else None
        if async_scheduling is not None:
            self.overlap = OverlappedSteps(self) if async_scheduling else None

    def set_drafter(self, drafter) -> None:
        """Speculate with ``drafter`` from now on (None: not at all), for benchmarks that compare
        drafters on one copy of the weights; an ``Eagle3Drafter`` or ``MtpDrafter`` loaded on this
        engine's model. Only those have the target keep the states they read."""
        if isinstance(drafter, StateDrafter) and self.pipeline is not None:
            raise ValueError(f"--pp {self.layout.pp} does not run with --speculative {drafter.name} yet")
        self.scheduler.drafter = drafter
        self.state_drafter = drafter if isinstance(drafter, StateDrafter) else None
        self.model.aux_layers = self.state_drafter.aux_layers if self.state_drafter is not None else ()

    @property
    def eagle3(self) -> Eagle3Drafter | None:
        """The EAGLE-3 drafter, if this engine drafts with one."""
        return self.state_drafter if isinstance(self.state_drafter, Eagle3Drafter) else None

    @property
    def mtp(self) -> MtpDrafter | None:
        """The MTP drafter, if this engine drafts with one."""
        return self.state_drafter if isinstance(self.state_drafter, MtpDrafter) else None

    def close(self) -> None:
        """Stop the other ranks and unmap the KV cache (its files are removed)."""
        if self.ranks is not None:
            self.ranks.close()
        self.grammar.close()
        if self.tiers is not None and self.tiers.copier is not None:
            self.tiers.copier.close()
        self.kv_cache.close(unlink=True)

    def _enable_tiers(self) -> None:
        cfg, spec = self.config, self.kv_spec
        slots = cfg.host_kv_blocks if cfg.host_kv_blocks is not None else int(cfg.host_kv_gb * _GIB // spec.block_bytes)
        if slots <= 0:
            raise ValueError(f"--host-kv-gb {cfg.host_kv_gb} holds no KV block of {spec.block_bytes} bytes")
        disk = None
        if cfg.disk_kv_dir:
            identity = model_identity(cfg.model, cfg.model_name)
            layout = {k: v for k, v in spec.to_dict().items() if k != "num_blocks"}
            cap = (cfg.disk_kv_blocks * (HEADER.size + spec.block_bytes) if cfg.disk_kv_blocks is not None
                   else int(cfg.disk_kv_gb * _GIB))
            # checksums keyed with the mesh secret: a file planted without it is never read back as KV
            disk = DiskTier(cfg.disk_kv_dir, cap, layout_fingerprint(identity, layout), spec.block_bytes,
                            self.pool.events, checksum_key=cfg.hash_key.subkey("disk-tier checksum"))
        kv = self.kv_cache
        # beside a KV pool in shared memory, the host tier's slots too: a peer on this host reads
        # the blocks it fetches out of both (kvstore/transfer/fetch.py, lent runs)
        slots_path = kv.shm_path + ".host" if isinstance(kv, KVCache) and kv.shm_path else None
        self.enable_tiers(slots, copier=BlockCopier(kv, slots, shm_path=slots_path), disk=disk,
                          disk_min_hits=cfg.disk_min_hits)
        log.info("KV tiers: host %d blocks (%.2f GiB)%s", slots, slots * spec.block_bytes / _GIB,
                 f", disk {disk.dir} up to {cap / _GIB:g} GiB ({len(disk)} blocks found)" if disk else "")

    def _auto_num_blocks(self, max_len: int, graphs: bool = False) -> int:
        mc = self.model_config
        block_bytes = mc.kv_cache_spec(1, self.config.block_size, self.kv_dtype).block_bytes
        if self.device.type == "cuda":
            # each GPU holds its share of the heads of its stage's layers (the largest stage's here)
            block_bytes = block_bytes * max(self.layout.stage_layers) // (mc.num_layers * self.layout.tp)
            free, total = torch.cuda.mem_get_info(self.device)
            # This worker may use ``kv_memory_fraction`` of the whole device (weights, KV, activations),
            # so several workers (two models, say) share one GPU by giving each a fraction.
            # Leave room for the activations and logits of a full step, and the decode graphs' pool.
            reserve = _GIB + self.config.max_num_seqs * mc.vocab_size * 8
            if graphs:
                elem = torch.empty((), dtype=self.dtype).element_size()
                qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                reserve += graph_memory_bytes(mc.hidden_size, mc.intermediate_size, qkv,
                                              self.config.max_num_seqs, elem)
            own = torch.cuda.memory_allocated(self.device)  # the weights, with one rank
            budget = min(free, total * self.config.kv_memory_fraction - own) - reserve
            budget = max(budget, block_bytes * 64)
        else:
            budget = min(self.config.cpu_kv_gib * _GIB, _available_memory() * 0.25)
        want = self.config.max_num_seqs * -(-max_len // self.config.block_size)
        return max(16, min(int(budget // block_bytes), want))


class _Started:
    """A step in flight (``Engine.start``): ``result()`` its tokens; a failure closes the group."""

    def __init__(self, started: StartedStep, failed):
        self.started, self.failed = started, failed

    def result(self) -> list[SampledToken]:
        try:
            return self.started.result()
        except Exception as e:
            raise self.failed(e) from e


def _rank_kv_files(config: EngineConfig, device: torch.device) -> str | None:
    """Where the other ranks put their KV shards (``{this}.r{rank}``): on CPU, files rank 0
    maps (next to its own in shared memory, if it has one); on CUDA, nowhere."""
    if device.type != "cpu":
        return None
    if config.kv_shm_path:
        return config.kv_shm_path
    from kvstore.transfer.shm import shm_path

    return shm_path(f"tp-{secrets.token_hex(4)}")


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GIB
