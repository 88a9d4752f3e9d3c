"""LoRA adapters in PEFT format, and the engine's table of them.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with a
``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` per targeted module; a targeted projection
computes ``W x + scale * B A x`` (``scale = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
Our decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so each adapter
is held per *fused* projection (``Projection``): one (A, B) pair per slice of its output, the
scale folded into B. ``read_adapter`` checks everything once, at load, and a broken
directory is one ``LoraError`` naming the file.

``LoraManager`` is the engine's one owner of adapters: the loaded ones by name (held in host
memory), and, through ``engine.lora_layers``, the ``max_loras`` device slots a step's
adapters run from (least recently used out) and the batched LoRA matmul of each step.

Who holds what: the manager holds every loaded adapter until ``unload``; a ``Sequence`` holds
its own adapter (``seq.lora``), so a request keeps running after its adapter is unloaded, and
the slot table only ever holds copies (evicting one loses nothing).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load as load_safetensors

from engine.config import ModelConfig
from engine.lora_adapter import LoraAdapter, SliceWeights
from engine.lora_layers import LoraBatch, LoraLinear, LoraSlots, LoraTable, projections
from mesh.errors import LoraError

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")

# PEFT module name -> (our fused projection, which slice of its output)
MODULES = {
    "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
    "self_attn.o_proj": ("o", 0),
    "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", 0),
}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn\.\w+|mlp\.\w+)\.lora_([AB])\.weight$")
# adapter_config.json settings that change the output and that we do not implement
_UNSUPPORTED = {
    "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights", "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "target_parameters": "LoRA on parameters (expert weights)", "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA",
}


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, model_name: str, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read and check a PEFT LoRA directory for this model; ``LoraError`` names the file at fault."""
    if not NAME.fullmatch(name):
        raise LoraError(f"LoRA adapter name {name!r} must be 1-128 letters, digits or ._:/@+- "
                        "(starting with a letter or digit)")
    path = Path(path)
    if not path.is_dir():
        raise LoraError(f"LoRA adapter directory {path} does not exist")
    conf_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    peft = _read_config(conf_file)
    if not weights_file.is_file():
        extra = " (adapter_model.bin is a pickle: save the adapter with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise LoraError(f"{path} has no {WEIGHTS_FILE}{extra}")
    try:
        raw = weights_file.read_bytes()
        tensors = load_safetensors(raw)
    except Exception as e:  # safetensors raises its own types for truncated or corrupt files
        raise LoraError(f"cannot read {weights_file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    fingerprint = xxhash.xxh3_64_hexdigest(raw + json.dumps(peft, sort_keys=True).encode())
    adapter = LoraAdapter(name, path, fingerprint, 0)
    pairs = _pair_tensors(tensors, weights_file, cfg)
    for (layer, module), (a, b) in sorted(pairs.items()):
        group, index = MODULES[module]
        proj = projections(cfg, layer).get(group)
        if proj is None:
            raise LoraError(f"{weights_file}: layer {layer} has no dense {module} (a mixture-of-experts "
                            "layer): LoRA on expert weights is not supported")
        r, want_in, want_out = a.shape[0], proj.in_features, proj.out_features[index]
        if a.shape != (r, want_in) or b.shape != (want_out, r):
            raise LoraError(f"{weights_file}: {module} of layer {layer} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; this model needs ({r}, {want_in}) and ({want_out}, {r})")
        if r > max_rank:
            raise LoraError(f"{weights_file}: rank {r} of {module} exceeds the engine's max LoRA rank {max_rank} (--max-lora-rank)")
        scale = _alpha(peft, f"model.layers.{layer}.{module}", r) / (math.sqrt(r) if peft.get("use_rslora") else r)
        slices = list(adapter.weights.get((layer, group), (None,) * len(proj.out_features)))
        slices[index] = SliceWeights(a.to(dtype).contiguous(), (b.double() * scale).to(dtype).contiguous())
        adapter.weights[(layer, group)] = tuple(slices)
        adapter.rank = max(adapter.rank, r)
    if not adapter.weights:
        raise LoraError(f"{weights_file} holds no LoRA weights")
    return adapter


def _read_config(conf_file: Path) -> dict:
    if not conf_file.is_file():
        raise LoraError(f"{conf_file.parent} has no {CONFIG_FILE}")
    try:
        peft = json.loads(conf_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{conf_file} is not valid JSON: {e}") from None
    if not isinstance(peft, dict):
        raise LoraError(f"{conf_file} is not a JSON object")
    kind = str(peft.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoraError(f"{conf_file}: peft_type {kind} is not a LoRA adapter")
    for key, what in _UNSUPPORTED.items():
        if peft.get(key):
            raise LoraError(f"{conf_file}: {what} ({key}) is not supported")
    if peft.get("bias", "none") != "none":
        raise LoraError(f"{conf_file}: bias {peft['bias']!r} is not supported (only \"none\")")
    if not isinstance(peft.get("lora_alpha", 8), int | float) or not isinstance(peft.get("alpha_pattern") or {}, dict):
        raise LoraError(f"{conf_file}: lora_alpha must be a number and alpha_pattern an object")
    return peft


def _pair_tensors(tensors: dict[str, torch.Tensor], weights_file: Path,
                  cfg: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if not m or m.group(2) not in MODULES:
            raise LoraError(f"{weights_file}: tensor {key} is not a LoRA weight of a q/k/v/o/gate/up/down "
                            "projection (the modules adapters may target here)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"{weights_file}: tensor {key} is for layer {layer}; the model has {cfg.num_layers}")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoraError(f"{weights_file}: tensor {key} is not a 2-D floating-point matrix")
        found.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor
    pairs = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoraError(f"{weights_file}: {module} of layer {layer} has no {missing}")
        pairs[(layer, module)] = (ab["A"], ab["B"])
    return pairs


def _alpha(peft: dict, module_path: str, rank: int) -> float:
    """``lora_alpha``, or the first ``alpha_pattern`` entry matching the module (PEFT's rule:
    the pattern matches the end of the module path)."""
    for pattern, alpha in (peft.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            return float(alpha)
    return float(peft.get("lora_alpha", 8))


class LoraManager:
    """The engine's adapters: loaded by name (host memory), run from ``max_loras`` device slots.

    ``load``/``unload`` may come from any thread; ``activate`` and ``plan`` (once per step, in
    the step's thread) are the only ones to touch the device slots, so an unload reaches the
    slots at the next step."""

    def __init__(self, cfg: ModelConfig, model_name: str, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.model_name, self.max_rank = cfg, model_name, max_rank
        self.device, self.dtype = device, dtype
        self.adapters: dict[str, LoraAdapter] = {}
        self._served: dict[str, str] = {}  # name -> fingerprint of every adapter loaded so far
        self._unloaded: list[LoraAdapter] = []  # to free from the slots at the next step
        self.slots = LoraSlots(max_loras)
        self.table = LoraTable(cfg, max_loras, max_rank, device, dtype)
        self.batch: LoraBatch | None = None  # this step's adapter rows; read by every LoraLinear

    # -- adapters by name ------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read, check and register an adapter; loading the same directory again is a no-op."""
        adapter = read_adapter(name, path, self.cfg, self.model_name, self.max_rank)
        current = self.adapters.get(name)
        if current is not None:
            if current.fingerprint == adapter.fingerprint:
                return current
            raise LoraError(f"LoRA adapter {name!r} is already loaded from {current.path}: unload it first")
        if self._served.get(name, adapter.fingerprint) != adapter.fingerprint:
            # its blocks are cached (on device, host or disk) under a seed made from the name
            raise LoraError(f"LoRA adapter name {name!r} served other weights before in this engine and "
                            "prefixes cached under it would be stale: load these weights under a new name")
        self._served[name] = adapter.fingerprint
        self.adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, adapter.path, adapter.rank,
                 ", ".join(sorted(adapter.groups)))
        return adapter

    def unload(self, name: str) -> LoraAdapter | None:
        """Forget an adapter: new requests cannot name it; running ones finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            self._unloaded.append(adapter)
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    # -- the device side -------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Wrap every projection adapters can target with its ``LoraLinear``."""
        for (i, group), entry in self.table.entries.items():
            layer = model.layers[i]
            parent, attr = {"qkv": (layer.self_attn, "qkv_proj"), "o": (layer.self_attn, "o_proj"),
                            "gate_up": (layer.mlp, "gate_up_proj"), "down": (layer.mlp, "down_proj")}[group]
            setattr(parent, attr, LoraLinear(getattr(parent, attr), entry, self))

    def activate(self, adapters: list[LoraAdapter | None]) -> list[int]:
        """The slot of each sequence's adapter this step (-1: the base model), after bringing the
        step's adapters into the front slots. At most ``max_loras`` distinct adapters (the
        scheduler's bound)."""
        while self._unloaded:
            self.slots.forget(self._unloaded.pop())
        wanted = list({id(a): a for a in adapters if a is not None}.values())
        if wanted:
            self.table.apply(self.slots.place(wanted))
        slot = {id(a): self.slots.slot_of(a) for a in wanted}
        return [-1 if a is None else slot[id(a)] for a in adapters]

    def plan(self, query_lens: list[int], slots: list[int] | None) -> bool:
        """Set this step's ``batch`` from each sequence's slot; True when any row runs an adapter."""
        self.batch = LoraBatch.plan(query_lens, slots, self.device) if slots and max(slots) >= 0 else None
        return self.batch is not None


def start_lora(config, cfg: ModelConfig, model: torch.nn.Module, device: torch.device,
               dtype: torch.dtype) -> LoraManager:
    """The LoRA side of an engine (``config.lora_slots`` > 0): the slots, the model's
    projections wrapped, the adapters of ``config.loras`` loaded."""
    manager = LoraManager(cfg, config.model_name, config.lora_slots, config.max_lora_rank, device, dtype)
    manager.attach(model)
    for name, path in config.loras:
        manager.load(name, path)
    log.info("LoRA: %d slots of rank %d (%.1f MiB)", config.lora_slots, config.max_lora_rank,
             manager.table.nbytes / (1 << 20))
    return manager
