"""Model and engine configuration, validated once when an engine starts."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from engine.attention import backend_names
from engine.fp8 import Fp8Scheme
from engine.kernels import FUSED_KERNELS
from engine.mla_config import MlaConfig
from engine.moe_config import MoeConfig
from engine.rope import RopeConfig
from engine.spec.registry import SpecConfig
from kvstore.cache import KVCacheSpec
from kvstore.hashing import DEFAULT_HASH_KEY, HashKey
from kvstore.kv_dtype import kv_cache_dtype
from mesh.errors import ModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(frozen=True)
class FamilyTraits:
    """What sets a family's decoder apart from plain Llama (one row per family, no if-chains)."""

    qkv_bias: bool = False  # q/k/v projections carry biases
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation
    sliding_window_default: bool = False  # ``use_sliding_window`` when a config leaves it out
    moe: bool = False  # sparse mixture-of-experts MLPs (``MoeConfig``)
    mla: bool = False  # multi-head latent attention (``MlaConfig``, ``engine.mla``)


FAMILY_TRAITS = {
    "llama": FamilyTraits(),
    "mistral": FamilyTraits(sliding_window_default=True),
    "qwen2": FamilyTraits(qkv_bias=True),
    "qwen3": FamilyTraits(qk_norm=True),
    "mixtral": FamilyTraits(sliding_window_default=True, moe=True),
    "qwen2_moe": FamilyTraits(qkv_bias=True, moe=True),
    "qwen3_moe": FamilyTraits(qk_norm=True, moe=True),
    "deepseek_v3": FamilyTraits(moe=True, mla=True),
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    moe: MoeConfig | None = None  # sparse MLPs (mixture of experts); None: every MLP is dense
    # multi-head latent attention (DeepSeek-V3); then ``head_dim`` is the rope dims and
    # ``num_kv_heads`` 1: the cache holds one latent vector per token, not K and V per head
    mla: MlaConfig | None = None
    fp8: Fp8Scheme | None = None  # FP8 weights in DeepSeek's block-scaled format (``engine.fp8``)
    # DeepSeek-V3's multi-token-prediction layers, stored after the last decoder layer
    # (``num_nextn_predict_layers``): not part of the model; ``--speculative mtp`` drafts with them
    mtp_layers: int = 0

    def is_sparse(self, layer: int) -> bool:
        """Does ``layer`` run a mixture-of-experts MLP (else the dense one)?"""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"model directory {path} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{path} has no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ModelError(f"{cfg_file} is not a JSON object")
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        family = SUPPORTED_ARCHITECTURES.get(arch) if arch else cfg.get("model_type")
        if family not in SUPPORTED_ARCHITECTURES.values():
            name = arch or cfg.get("model_type") or "unknown"
            raise ModelError(
                f"unsupported architecture {name} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        traits = FAMILY_TRAITS[family]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            num_layers = int(cfg["num_hidden_layers"])
            mla = MlaConfig.from_hf(cfg) if traits.mla else None
            if mla is not None:
                head_dim = mla.qk_rope_head_dim
            model = cls(
                path=path,
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size") or 0),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=1 if mla else int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position=_max_position(cfg, traits),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=not mla and (bool(cfg.get("qkv_bias", traits.qkv_bias))
                                      or bool(cfg.get("attention_bias", False))),
                qk_norm=traits.qk_norm,
                rope=RopeConfig.from_hf(cfg),
                eos_token_ids=_eos_ids(path, cfg),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                moe=MoeConfig.from_hf(cfg, family, num_layers) if traits.moe else None,
                mla=mla,
                fp8=Fp8Scheme.from_config(cfg),
                mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"{cfg_file} is malformed: {type(e).__name__}: {e}") from None
        model._check(cfg_file)
        return model

    def _check(self, cfg_file: Path) -> None:
        if self.intermediate_size <= 0 and len(self.moe.sparse_layers if self.moe else ()) < self.num_layers:
            raise ModelError(f"{cfg_file} has dense MLP layers but no intermediate_size")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )

    def check_tp(self, tp: int, ep: int = 1) -> None:
        """Can ``tp`` ranks split the heads and MLP columns evenly? (ModelError if not)"""
        if self.mla is not None and tp > 1:
            # the heads would split cleanly, but every rank needs the whole latent cache, and the
            # sharded KV view, the transports and peer fetch all split a block by heads
            raise ModelError(f"--tp {tp} is not supported for MLA models ({self.family}) yet: use --tp 1"
                             + (" (--ep splits the experts alone)" if self.moe is not None else ""))
        sizes = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                 "intermediate_size": self.intermediate_size}
        if self.moe is not None and ep == 1:  # every expert (and the shared one) is split like the dense MLP
            sizes["moe_intermediate_size"] = self.moe.intermediate_size
            sizes["shared_expert_intermediate_size"] = self.moe.shared_expert_intermediate_size
        bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
        if bad:
            raise ModelError(f"--tp {tp} must divide {' and '.join(bad)}")

    def check_ep(self, ep: int) -> None:
        """Can ``ep`` ranks hold the routed experts in equal shares? (ModelError if not)"""
        if ep == 1:
            return
        if self.moe is None:
            raise ModelError(f"--ep {ep} needs a mixture-of-experts model; {self.family} is dense")
        if self.moe.num_experts % ep:
            raise ModelError(f"--ep {ep} must divide the model's {self.moe.num_experts} routed experts")

    def kv_cache_spec(self, num_blocks: int, block_size: int, dtype: torch.dtype, tp: int = 1,
                      num_layers: int | None = None) -> KVCacheSpec:
        """One rank's KV cache: K and V planes of its share of the KV heads, or (MLA) one plane of
        one latent vector per token and layer; of ``num_layers`` (a pipeline stage's) or all."""
        layers = self.num_layers if num_layers is None else num_layers
        if self.mla is not None:
            return KVCacheSpec(layers, num_blocks, block_size, 1, self.mla.latent_dim, dtype, num_planes=1)
        return KVCacheSpec(layers, num_blocks, block_size, self.num_kv_heads // tp, self.head_dim, dtype)

    @property
    def latent_dims(self) -> tuple[int, int] | None:
        """MLA: the (latent, rope key) values of each cached vector; None for K/V attention."""
        return (self.mla.kv_lora_rank, self.mla.qk_rope_head_dim) if self.mla else None

    @property
    def latent_value_dim(self) -> int:
        """MLA: the latent's share of each cached vector (what a latent backend returns per head); 0 otherwise."""
        return self.mla.kv_lora_rank if self.mla else 0

    @property
    def attention_scale(self) -> float:
        """The attention softmax scale: 1/sqrt(head dim); MLA's over its query/key dims before
        absorption (nope + rope), times DeepSeek's YaRN ``mscale_all_dim`` correction."""
        if self.mla is not None:
            return self.mla.qk_head_dim**-0.5 * self.rope.softmax_mscale
        return self.head_dim**-0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache at the checkpoint's dtype, all layers."""
        return self.kv_cache_spec(1, 1, DTYPES.get(self.torch_dtype, torch.float32)).block_bytes


def _max_position(cfg: dict, traits: FamilyTraits) -> int:
    n = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", traits.sliding_window_default)
    if window and uses_window:
        # Sliding-window attention is not implemented: serve contexts that fit the window.
        n = min(n, int(window))
    return n


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [cfg]
    if gen.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            sources.insert(0, json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        for e in eos if isinstance(eos, list) else [eos]:
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


# GPU execution defaults (issue 21). Off until bench/gpu_check.sh has run tests/gpu on a device;
# each is the one line to change once it has.
CUDA_GRAPHS_DEFAULT = False  # CUDA: decode steps replay CUDA graphs (--cuda-graphs / --enforce-eager)
ASYNC_SCHEDULING_DEFAULT_CUDA = False  # CUDA: overlap scheduling with the device (--async-scheduling)


@dataclass(frozen=True)
class EngineConfig:
    """A model engine's configuration; its flags are ``engine.flags`` (which loads no torch)."""

    simulated: ClassVar[bool] = False  # a model, not a timing model (``worker.settings.SimulatedEngineConfig``)
    model: str | Path
    served_name: str | None = None  # the model name on the bus; defaults to the directory name
    hash_key: HashKey = DEFAULT_HASH_KEY  # the mesh's block-hash secret (the CLI's --hash-key-file)
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    kv_cache_dtype: str = "auto"  # the KV pool's: auto (the engine's dtype), fp8 (= fp8_e4m3), fp8_e5m2
    device: str | None = None  # default: cuda if available
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: what memory allows
    kv_memory_fraction: float = 0.85  # GPU: share of the whole device this worker may use (weights + KV)
    cpu_kv_gib: float = 4.0  # CPU: cap for the KV pool when num_kv_blocks is not given
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_with_decode: int = 512  # prompt tokens in a step that also decodes (stall-free; 0: no cap)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # default: flashinfer on CUDA, torch otherwise
    cuda_graphs: bool | None = None  # CUDA: replay decode steps from CUDA graphs; None: CUDA_GRAPHS_DEFAULT
    kv_shm_path: str | None = None  # CPU: put the KV pool in this shared-memory file
    host_kv_gb: float = 0.0  # host tier (pinned RAM on CUDA): offloaded blocks; 0 = no tiers
    host_kv_blocks: int | None = None  # the host tier in blocks (overrides host_kv_gb)
    disk_kv_dir: str | None = None  # disk tier under this directory (needs a host tier)
    disk_kv_gb: float = 8.0  # cap of the disk tier
    disk_kv_blocks: int | None = None  # the disk tier's cap in blocks (overrides disk_kv_gb)
    disk_min_hits: int = 2  # a host eviction goes to disk once the block served this many prefix hits
    tp: int = 1  # tensor-parallel ranks: processes (one GPU each on CUDA) the model is sharded over
    ep: int = 1  # expert-parallel ranks: the routed experts split over them (the TP ranks, then experts-only ranks)
    pp: int = 1  # pipeline stages (x tp ranks each): contiguous runs of layers (engine.parallel)
    pp_layers: tuple[int, ...] = ()  # layers per stage; (): as even as they go
    pp_microbatches: int = 0  # at most this many micro-batches per step over the stages; 0: pp; 1: off
    pp_steps_in_flight: int = 0  # steps of disjoint sequences in flight over the stages; 0: pp; 1: off
    seed: int = 0
    loras: tuple[tuple[str, str], ...] = ()  # LoRA adapters loaded at start: (name, PEFT directory)
    max_loras: int | None = None  # adapters one step can run (device slots, LRU); None: 4 with loras, else off
    max_lora_rank: int = 16  # the largest adapter rank the slots hold
    # -- GPU execution (issue 21) --
    enforce_eager: bool = False  # never CUDA graphs, whatever the default
    async_scheduling: bool | None = None  # overlap host and device steps; None: on CUDA as the default says
    fused_kernels: tuple[str, ...] = ()  # FlashInfer kernels for these ops (engine.kernels.FUSED_KERNELS)
    grammar_backend: str = "llguidance"  # constrained output: llguidance or xgrammar
    grammar_threads: int = 0  # threads that fill the token masks; 0: the backend's default
    grammar_cache_size: int = 256  # compiled grammars kept per worker
    grammar_spin_ms: float = 3.0  # the grammar process polls this long for the next step before it sleeps
    speculative: str | None = None  # speculative decoding's drafter (engine.spec.drafter registry); None: off
    num_speculative_tokens: int = 4  # tokens a decoding row drafts per step
    spec_adaptive: bool = True  # K adapts per row to its acceptance (engine.spec.adaptive); False: fixed K

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_with_decode < 0:
            raise ValueError("max_prefill_with_decode must be >= 0 (0: no cap)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # ValueError: not one of vLLM's values
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.host_kv_gb < 0 or (self.host_kv_blocks is not None and self.host_kv_blocks < 0):
            raise ValueError("the host KV tier cannot be negative")
        if self.disk_kv_gb <= 0 or self.disk_min_hits < 0:
            raise ValueError("disk_kv_gb must be > 0 and disk_min_hits >= 0")
        if self.disk_kv_blocks is not None and self.disk_kv_blocks <= 0:
            raise ValueError(f"disk_kv_blocks must be > 0, got {self.disk_kv_blocks}")
        if self.disk_kv_blocks is not None and not self.disk_kv_dir:
            raise ValueError("the disk KV tier needs a directory: give --disk-kv-dir too")
        if self.disk_kv_dir and not self.has_host_tier:
            raise ValueError("the disk KV tier is fed by the host tier: give --host-kv-gb too")
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"tp and ep must be >= 1, got {self.tp} and {self.ep}")
        self._check_pipeline()
        if self.grammar_threads < 0 or self.grammar_cache_size < 1 or not 0 <= self.grammar_spin_ms <= 1000:
            raise ValueError("grammar_threads must be >= 0, grammar_cache_size >= 1 and grammar_spin_ms in [0, 1000]")
        if self.max_loras is not None and self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be in 1..1024, got {self.max_lora_rank}")
        names = [name for name, _ in self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must be unique, got {', '.join(names)}")
        if self.loras and self.max_loras == 0:
            raise ValueError("LoRA adapters were given but max_loras is 0 (LoRA off)")
        if self.tp > 1 and self.lora_slots:
            raise ValueError("LoRA adapters are not supported with --tp > 1 yet")
        if self.disk_kv_dir and self.lora_slots:
            # adapter blocks are named by the adapter's name; the disk tier outlives this process,
            # and a name loaded with other weights after a restart would hit stale blocks
            raise ValueError("LoRA adapters are not supported with a disk KV tier yet (--disk-kv-dir)")
        if self.lora_slots and self.async_scheduling:
            raise ValueError("LoRA adapters are not supported with --async-scheduling yet")
        self._check_gpu_execution()
        if self.speculative is not None:
            SpecConfig(self.speculative, self.num_speculative_tokens)  # ValueError: an unknown method, K < 1
            method = self.speculative.partition(":")[0]
            if self.ep > 1 and method in ("eagle3", "mtp"):  # their drafters run on the TP ranks only
                raise ValueError(f"--speculative {method} does not run with --ep > 1 yet")

    def _check_pipeline(self) -> None:
        """What pipeline stages do not run yet is refused here, in one line (the layer split
        itself is checked against the model when the engine starts: ``Layout.for_model``)."""
        if self.pp < 1 or self.pp_microbatches < 0:
            raise ValueError(f"--pp must be >= 1 and --pp-microbatches >= 0, got {self.pp} and {self.pp_microbatches}")
        if self.pp_layers and len(self.pp_layers) != self.pp:
            raise ValueError(f"--pp-layers names {len(self.pp_layers)} stages, --pp is {self.pp}")
        if not 0 <= self.pp_steps_in_flight <= self.pp:
            raise ValueError(f"--pp-steps-in-flight must be 0 (one per stage) to --pp ({self.pp}), "
                             f"got {self.pp_steps_in_flight}")
        if self.pp_steps_in_flight > 1 and self.async_scheduling:
            raise ValueError(f"--async-scheduling and --pp-steps-in-flight {self.pp_steps_in_flight} contradict each "
                             "other (steps in flight already overlap rank 0's work; --pp-steps-in-flight 1 to choose "
                             "async scheduling)")
        if self.pp_steps_in_flight > 1 and self.has_host_tier:
            raise ValueError(f"--pp-steps-in-flight {self.pp_steps_in_flight} does not run with the KV tiers yet "
                             "(an offload could read a block a step in flight still writes)")
        if self.pp == 1:
            return
        refused = [flag for flag, on in (
            ("--lora", bool(self.lora_slots)), ("--cuda-graphs", bool(self.cuda_graphs)),
            ("--speculative eagle3", (self.speculative or "").startswith("eagle3")),
            ("--speculative mtp", (self.speculative or "").partition(":")[0] == "mtp")) if on]
        if refused:
            raise ValueError(f"--pp {self.pp} does not run with {', '.join(refused)} yet")

    @property
    def pipeline_microbatches(self) -> int:
        """At most this many micro-batches per step (1: micro-batching off). By default one per
        stage: on a CPU each micro-batch reads the stage's weights again, and two per stage cost
        more in those reads than they gain in overlap (python -m bench parallel)."""
        return self.pp_microbatches or self.pp

    @property
    def pipeline_steps_in_flight(self) -> int:
        """Steps of disjoint sequences in flight over the stages at once (``engine.inflight``; 1:
        one step at a time, cut into micro-batches). By default one per stage, unless the
        engine schedules asynchronously or has KV tiers, which run one step at a time."""
        if self.pp == 1 or self.async_scheduling or self.has_host_tier:
            return self.pp_steps_in_flight or 1
        return self.pp_steps_in_flight or self.pp

    def _check_gpu_execution(self) -> None:
        if self.attention_backend is not None and self.attention_backend not in backend_names():
            raise ValueError(f"unknown attention backend {self.attention_backend!r} "
                             f"(available: {', '.join(backend_names())})")
        if self.enforce_eager and self.cuda_graphs:
            raise ValueError("--enforce-eager and --cuda-graphs contradict each other")
        if self.async_scheduling and self.ep > 1:
            raise ValueError("--async-scheduling is not supported with --ep > 1 yet (the expert ranks would "
                             "need the sampled tokens)")
        if self.cuda_graphs and (self.tp > 1 or self.ep > 1) and self.pp == 1:  # (--pp > 1: refused with the others)
            raise ValueError(f"--cuda-graphs is not supported with --tp {self.tp} --ep {self.ep} yet (only rank 0 would replay)")
        unknown = [k for k in self.fused_kernels if k not in FUSED_KERNELS]
        if unknown:
            raise ValueError(f"unknown fused kernel(s) {', '.join(unknown)} (choose from {', '.join(FUSED_KERNELS)})")

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs (where the device and attention backend allow)."""
        if self.enforce_eager:
            return False
        return CUDA_GRAPHS_DEFAULT if self.cuda_graphs is None else self.cuda_graphs

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (ASYNC_SCHEDULING_DEFAULT_CUDA and self.torch_device.type == "cuda"
                and self.ep == 1 and self.pipeline_steps_in_flight == 1
                and not self.lora_slots)  # LoRA steps run the blocking loop

    @property
    def lora_slots(self) -> int:
        """Device slots for LoRA adapters; 0: LoRA is off."""
        if self.max_loras is not None:
            return self.max_loras
        return 4 if self.loras else 0

    @property
    def has_host_tier(self) -> bool:
        return bool(self.host_kv_blocks) if self.host_kv_blocks is not None else self.host_kv_gb > 0

    @property
    def torch_device(self) -> torch.device:
        if self.device:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype:
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype (``--kv-cache-dtype``): FP8, or the engine's own."""
        return kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def model_name(self) -> str:
        return self.served_name or Path(self.model).name
