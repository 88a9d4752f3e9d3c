"""The part of an engine that is not the model: requests, blocks, scheduling.

``EngineCore`` owns the block pool, the scheduler and the request lifecycle
(local prefill, remote prefill, hold-and-release for prefill workers). A
subclass supplies ``execute()``: the real engine runs the model, the mocker
sleeps per a timing model. Workers talk to either through this interface, so
the mocker speaks exactly the worker protocol. No torch here.

KV tiers (``enable_tiers``): the device pool's evictions go to a host tier (and
from there to disk), and prefix hits below the device are onboarded at
admission. The real engine passes a ``BlockCopier`` that moves the bytes; the
mocker may run a host tier without one (bookkeeping only, so hit rates are
still modelled). ``kv_snapshot`` and ``kv_counters`` cover every tier.

Peer fetch: ``pins`` pins the blocks this engine sends to a peer (``kvstore.pins``);
``stage_peer_blocks`` takes the blocks a peer sent for an admission about to happen.

Overlapped scheduling (``async_scheduling``, ``engine.overlap``): ``step()``
launches the next step before resolving the previous one, so its outputs are
one step behind. The subclass then provides ``launch()`` as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.overlap import OverlappedSteps
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepOutput
from engine.sequence import SampledToken, Sequence
from engine.spec.drafter import Drafter, can_draft
from engine.spec.registry import create_drafter
from kvstore.hashing import DEFAULT_HASH_KEY, HashKey, HashSeed, hash_seed
from kvstore.manager import KVCacheManager
from kvstore.pins import KvPins, PinnedRun
from kvstore.pool import BlockPool
from kvstore.tiers import BlockCopier, HostTier, TieredCache
from mesh.errors import LoraError, RequestError, UnknownAdapterError


@dataclass(frozen=True)
class CoreConfig:
    model_name: str
    vocab_size: int
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_with_decode: int = 0  # prompt tokens in a step that also decodes (0: the whole budget)
    eos_token_ids: tuple[int, ...] = ()
    enable_prefix_caching: bool = True
    max_loras: int = 0  # LoRA adapters one step can run; 0: LoRA off
    async_scheduling: bool = False  # overlap host work with the device's step (needs launch())
    hash_key: HashKey = DEFAULT_HASH_KEY  # the mesh's block-hash secret (kvstore/hashing.py)
    speculative: str | None = None  # speculative decoding: the drafter (engine.spec.drafter registry)
    num_speculative_tokens: int = 4  # tokens a decoding row drafts per step
    spec_adaptive: bool = True  # K adapts per row (engine.spec.adaptive); False: every row drafts K


class _Done:
    """A step that already ran: ``launch`` of an engine without asynchronous execution."""

    def __init__(self, tokens: list[SampledToken]):
        self.tokens = tokens

    def result(self) -> list[SampledToken]:
        return self.tokens


class EngineCore:
    def __init__(self, core: CoreConfig, drafter: Drafter | None = None):
        """``drafter``: speculative decoding's, instead of the one ``core.speculative`` names (the mocker's)."""
        self.core_config = core
        self.model_name = core.model_name
        self.block_size = core.block_size
        self.vocab_size = core.vocab_size
        self.pool = BlockPool(core.num_blocks, enable_caching=core.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, core.block_size)
        # A lone sequence must always fit the pool, or preemption could never make room for it.
        self.max_model_len = min(core.max_model_len, core.num_blocks * core.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=core.max_num_seqs,
                max_num_batched_tokens=core.max_num_batched_tokens,
                max_prefill_with_decode=core.max_prefill_with_decode,
                max_model_len=self.max_model_len,
                eos_token_ids=core.eos_token_ids,
                max_loras=core.max_loras,
                num_speculative_tokens=core.num_speculative_tokens if core.speculative else 0,
                spec_adaptive=core.spec_adaptive,
            ),
            self.kv_manager,
        )
        if core.speculative:
            self.scheduler.drafter = drafter or create_drafter(core.speculative)
        self.hash_key = core.hash_key
        self.hash_seed = self.seed_for()  # the base model's, in no cache scope
        self.num_steps = 0
        self.kv_cache = None  # engines with real KV bytes set this (transports need it)
        self.tiers: TieredCache | None = None  # enable_tiers()
        self.lora = None  # a LoraManager (engine.lora) when the engine serves LoRA adapters
        self.pins = KvPins(self.pool)  # blocks being sent to peers
        self.grammar = None  # a GrammarManager where the engine enforces constraints (the real engine)
        self._ids = itertools.count()
        self.overlap = OverlappedSteps(self) if core.async_scheduling else None

    # -- KV tiers ---------------------------------------------------------------
    def enable_tiers(self, host_blocks: int, copier: BlockCopier | None = None, disk=None,
                     disk_min_hits: int = 2) -> TieredCache:
        """Offload evicted device blocks to a host tier of ``host_blocks`` slots (and on to
        ``disk``, a ``DiskTier`` or ``VirtualDiskTier`` built on ``self.pool.events``); onboard
        prefix hits from them. ``host_blocks`` 0: no offload, only blocks peers send are onboarded."""
        host = HostTier(host_blocks, self.pool.events) if host_blocks else None
        self.tiers = TieredCache(host, disk=disk, copier=copier, disk_min_hits=disk_min_hits)
        if host is not None:
            self.pool.on_evict = self.tiers.offload
        self.kv_manager.tiers = self.tiers
        self.pins.tiers = self.tiers
        return self.tiers

    def stage_peer_blocks(self, hashes: Seq[int], payloads: Seq | None = None) -> None:
        """Blocks a peer sent (a run of a prompt this engine is about to admit): the admission
        onboards them as a prefix hit from the ``peer`` source. Safe from any thread once the
        tiers exist (``enable_tiers``: an engine that fetches enables them when it is built)."""
        if self.tiers is None:
            raise RuntimeError("this engine takes no blocks from peers (no tiers enabled)")
        self.tiers.stage_peer(hashes, payloads)

    def kv_snapshot(self) -> dict[str, list[int]]:
        """Every cached block by tier (what a router resyncs from)."""
        out = {self.pool.tier: self.pool.cached_hashes()}
        if self.tiers is not None:
            out.update(self.tiers.snapshot())
        return out

    def kv_counters(self) -> dict[str, int]:
        """Blocks and prefix hits per tier, for load reports."""
        out = {
            "device_blocks": self.pool.num_cached,
            "hit_blocks_device": self.kv_manager.device_hit_blocks,
            "hit_blocks_host": 0, "hit_blocks_disk": 0, "hit_blocks_peer": 0,
        }
        if self.tiers is not None:
            out.update(self.tiers.counters())
        out.update(self.pins.counters())
        return out

    # -- the one thing a subclass provides --------------------------------------
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        raise NotImplementedError

    # -- and for overlapped scheduling --------------------------------------------
    def launch(self, out: SchedulerOutput, prev=None):
        """Start the step; a handle whose ``result()`` gives its tokens. ``prev``: the handle of
        the step in flight, whose sampled tokens some of this step's rows take as input."""
        return _Done(self.execute(out))

    def needs_resolved_tokens(self, out: SchedulerOutput) -> bool:
        """Whether the step after ``out`` (in flight) needs its tokens before it is scheduled:
        penalties count every token, and a grammar's next mask follows the token before it."""
        drafting = self.scheduler.drafter is not None
        # a row that drafts next needs its last token on the host (the drafter reads it); one whose
        # drafts stopped (adaptive K at 0, between probes) overlaps as a plain row
        return any(c.seq.params.has_penalties or c.seq.grammar is not None
                   or (drafting and can_draft(c.seq) and (c.seq.draft_length is None or c.seq.draft_length.due()))
                   for c in out.sampling_chunks)

    # -- requests ---------------------------------------------------------------
    def new_sequence(
        self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None,
        lora: str | None = None, cache_scope: str = "",
    ) -> Sequence:
        """A request of ``prompt_token_ids``, on LoRA adapter ``lora`` (None: the base model), whose
        blocks are named in ``cache_scope`` (its tenant and cache salt: prefixes are shared only within)."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} tokens"
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        adapter = self.lora_adapter(lora) if lora is not None else None
        return Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            params=params,
            block_size=self.block_size,
            hash_seed=self.seed_for(cache_scope, lora),
            lora=adapter,
        )

    def seed_for(self, cache_scope: str = "", lora: str | None = None) -> HashSeed:
        """The block-hash seed of a request in ``cache_scope`` on adapter ``lora`` (None: the base model)."""
        return hash_seed(self.hash_key, self.model_name, cache_scope, lora)

    # -- LoRA adapters (the real engine's LoraManager does the work) -----------------
    def lora_adapter(self, name: str):
        adapter = self.lora.get(name) if self.lora is not None else None
        if adapter is None:
            loaded = ", ".join(self.lora.names) if self.lora is not None and self.lora.names else "none"
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return adapter

    def load_lora(self, name: str, path: str):
        """Load a PEFT adapter at runtime (LoraError names the file at fault)."""
        if self.lora is None:
            raise LoraError("this engine serves no LoRA adapters: start it with max_loras > 0 (--max-loras)")
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter; requests already running on it finish. False if it was not loaded."""
        return self.lora is not None and self.lora.unload(name) is not None

    def add(self, seq: Sequence) -> None:
        self.attach_grammar(seq)
        self.scheduler.add(seq)

    def attach_grammar(self, seq: Sequence) -> None:
        """A constrained sequence gets its grammar state, caught up with the tokens it already generated
        (raises ``RequestError`` if this engine cannot enforce the constraint). Any thread, as long as
        the sequence is not added yet (workers call it in a thread first; ``add`` then finds it done)."""
        if seq.params.constraint is None:
            return
        if self.grammar is None:
            raise RequestError("this engine does not enforce constraints (response_format, tools)")
        self.grammar.attach(seq)

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished sequence's held blocks (after its KV was sent)."""
        self.scheduler.release(request_id)

    def num_uncached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens a prefill would compute, after this engine's prefix cache."""
        return seq.num_tokens - len(self.kv_manager.match_prefix(seq)) * self.block_size

    def reserve_remote(self, seq: Sequence) -> bool:
        self.attach_grammar(seq)  # the first token comes from the prefill worker, and advances it
        ok = self.scheduler.reserve_remote(seq)
        if ok and self.tiers is not None:
            # Another process writes the reserved blocks next: the offload copies that read
            # them (a GPU stream of ours) must be done first.
            self.tiers.sync()
        return ok

    def complete_remote(self, request_id: str, first: SampledToken) -> StepOutput | None:
        return self.scheduler.complete_remote(request_id, first)

    def fail_remote(self, request_id: str) -> Sequence | None:
        return self.scheduler.fail_remote(request_id)

    # -- named operations for workers (on the engine thread, between steps) -------------
    # A worker hands these to ``EngineLoop.call`` (``partial(EngineCore.hold_blocks, blocks=...)``)
    # rather than a closure that reaches into the pool or the pins.
    def admit(self, seq: Sequence, remote_min_tokens: int | None = None) -> tuple[list[int], int] | None:
        """Take a new request. With ``remote_min_tokens``, a prompt that has at least that many
        tokens past the prefix cache gets its blocks reserved for a prefill worker to write: returns
        its block table and cached tokens. Otherwise (or with no room to reserve) it is added for a
        local prefill: None."""
        if remote_min_tokens is not None and self.num_uncached_tokens(seq) >= remote_min_tokens \
                and self.reserve_remote(seq):
            return list(seq.block_table), seq.num_cached_tokens
        self.add(seq)
        return None

    def hold_blocks(self, blocks: Seq[int]) -> None:
        """One more reference on blocks in use (a fence: no reuse while a late writer may write them)."""
        self.pool.hold(blocks)

    def release_blocks(self, blocks: Seq[int]) -> None:
        """Drop the reference ``hold_blocks`` took."""
        self.pool.free(blocks)

    def pin_run(self, fetch_id: str, hashes: Seq[int], lease_s: float) -> PinnedRun:
        """Pin the leading run of ``hashes`` this engine holds in any tier, for a peer to read."""
        return self.pins.pin(fetch_id, hashes, lease_s)

    def unpin_run(self, fetch_id: str) -> bool:
        """The peer's read is over, however it ended (False: the pins had expired)."""
        return self.pins.release(fetch_id)

    def expire_pins(self) -> int:
        """Unpin the runs past their lease (their peer vanished); how many."""
        return self.pins.expire()

    def pinned_sources(self, fetch_id: str) -> list:
        """Where each block of a pinned run is (``KvPins.sources``; any thread: it reads disk)."""
        return self.pins.sources(fetch_id)

    def is_pinned(self, fetch_id: str) -> bool:
        return fetch_id in self.pins

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or (self.overlap is not None and self.overlap.inflight is not None)

    # -- stepping ---------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self.overlap is not None:
            return self.overlap.step()
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        return self.run_step(out)

    def run_step(self, out: SchedulerOutput) -> list[StepOutput]:
        """Execute a scheduled step and take its tokens."""
        sampled = self.execute(out)
        results = self.scheduler.update(out, sampled)
        if self.grammar is not None and out.sampling_chunks:
            self.grammar.tokens_taken([c.seq for c in out.sampling_chunks])  # their next masks start now
        self.num_steps += 1
        return results

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
        lora: str | Seq[str | None] | None = None,
    ) -> list[Sequence]:
        """Run prompts to completion (on one LoRA adapter, or one per prompt); sequences come
        back in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        seqs = [self.new_sequence(p, sp, lora=name)
                for p, sp, name in zip(prompts, plist, loras, strict=True)]
        for s in seqs:
            self.add(s)
        while any(not s.is_finished for s in seqs):
            if not self.has_work:
                raise RuntimeError("engine idle with unfinished sequences")
            self.step()
        if self.overlap is not None:
            self.overlap.finish()  # a step with only rows of sequences that stopped: nothing to emit
        return seqs
