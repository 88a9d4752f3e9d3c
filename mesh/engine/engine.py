"""The engine: schedule -> execute -> update, one step at a time, synchronously.

Workers run ``step()`` in a thread of their own (see ``mesh.engine.loop``);
``generate()`` runs prompts to completion in the calling thread (the CLI, tests,
benchmarks).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq

import torch

from kvstore.cache import KVCache, KVCacheSpec
from kvstore.manager import KVCacheManager
from kvstore.pool import BlockPool
from mesh.engine.attention import create_backend, default_backend
from mesh.engine.config import EngineConfig, ModelConfig
from mesh.engine.errors import RequestError
from mesh.engine.loader import load_model
from mesh.engine.runner import ModelRunner
from mesh.engine.sampler import Sampler
from mesh.engine.sampling import SamplingParams
from mesh.engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from mesh.engine.sequence import SampledToken, Sequence
from mesh.hashing import model_seed

log = logging.getLogger(__name__)

_GIB = 1 << 30


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = mc = ModelConfig.from_dir(config.model)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        max_len = min(config.max_model_len or mc.max_position, mc.max_position)
        self.model = load_model(mc, self.device, self.dtype, max_positions=max_len)
        bs = config.block_size
        num_blocks = config.num_kv_blocks or self._auto_num_blocks(max_len)
        self.kv_spec = KVCacheSpec(mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, self.dtype)
        self.kv_cache = KVCache(self.kv_spec, self.device, shm_path=config.kv_shm_path)
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, bs)
        # A lone sequence must always fit the pool, or preemption could never make room for it.
        self.max_model_len = min(max_len, num_blocks * bs)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                eos_token_ids=mc.eos_token_ids,
            ),
            self.kv_manager,
        )
        backend = config.attention_backend or default_backend(self.device)
        self.attention = create_backend(backend, self.kv_cache, mc.head_dim**-0.5)
        self.sampler = Sampler(self.device, config.seed)
        self.runner = ModelRunner(self.model, self.attention, self.sampler, bs)
        self.hash_seed = model_seed(config.model_name)
        self.num_steps = 0
        self._ids = itertools.count()
        log.info(
            "engine ready: %s (%s) on %s %s, %d KV blocks of %d tokens, attention %s",
            config.model_name, mc.family, self.device, str(self.dtype).removeprefix("torch."),
            num_blocks, bs, backend,
        )

    def _auto_num_blocks(self, max_len: int) -> int:
        block_bytes = KVCacheSpec(
            self.model_config.num_layers, 1, self.config.block_size,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.dtype,
        ).block_bytes
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            # leave room for activations and logits of a full step
            reserve = _GIB + self.config.max_num_seqs * self.model_config.vocab_size * 8
            budget = max(free * self.config.kv_memory_fraction - reserve, block_bytes * 64)
        else:
            budget = min(self.config.cpu_kv_gib * _GIB, _available_memory() * 0.25)
        want = self.config.max_num_seqs * -(-max_len // self.config.block_size)
        return max(16, min(int(budget // block_bytes), want))

    # -- requests -------------------------------------------------------------
    def new_sequence(
        self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} tokens"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
        return Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            params=params,
            block_size=self.config.block_size,
            hash_seed=self.hash_seed,
        )

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished sequence's held blocks (after its KV was sent)."""
        self.scheduler.release(request_id)

    def reserve_remote(self, seq: Sequence) -> bool:
        return self.scheduler.reserve_remote(seq)

    def complete_remote(self, request_id: str, first: SampledToken) -> StepOutput | None:
        return self.scheduler.complete_remote(request_id, first)

    def fail_remote(self, request_id: str) -> Sequence | None:
        return self.scheduler.fail_remote(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- stepping -------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        sampled = self.runner.execute(out)
        results = self.scheduler.update(out, sampled)
        self.num_steps += 1
        return results

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[Sequence]:
        """Run prompts to completion; sequences come back in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.new_sequence(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for s in seqs:
            self.add(s)
        while any(not s.is_finished for s in seqs):
            if not self.has_work:
                raise RuntimeError("engine idle with unfinished sequences")
            self.step()
        return seqs


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GIB
