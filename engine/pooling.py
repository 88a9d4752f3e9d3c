"""Embeddings from the engine's model: pooled, L2-normalised hidden states, no sampling, no KV cache.

``Embedder`` runs ``CausalLM.forward`` (the same model and loader as the serving engine) over a
batch of prompts packed into one flat token batch, with ``DenseCausalAttention`` in place of the
paged backends: each layer's keys and values live only for that layer's call, so nothing but the
forward's own activations is allocated. The final norm is applied (Hugging Face's
``last_hidden_state``), then each sequence is pooled, normalised and, for a matryoshka model,
truncated and normalised again.

How a model pools (``PoolingConfig.from_dir``): sentence-transformers' ``modules.json`` and its
Pooling module's ``config.json`` when the directory has them, else the worker's ``--pooling``
(``last`` by default: a decoder LM's last token has seen the whole input). Matryoshka truncation
is allowed where ``config.json`` declares it as vLLM reads it: ``matryoshka_dimensions`` (the
sizes allowed) or ``is_matryoshka`` (any size up to the hidden size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import EngineConfig, ModelConfig
from engine.loader import load_model
from mesh.errors import ModelError, RequestError

POOLING_METHODS = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str = "last"  # last | mean | cls
    matryoshka: bool = False  # the vector may be truncated (``dimensions``)
    dimensions: tuple[int, ...] = ()  # the sizes it may be truncated to; (): any

    def __post_init__(self):
        if self.method not in POOLING_METHODS:
            raise ValueError(f"unknown pooling {self.method!r} (choose from {', '.join(POOLING_METHODS)})")

    @classmethod
    def from_dir(cls, path: str | Path, default: str = "last") -> PoolingConfig:
        """The model directory's pooling (sentence-transformers' files), else ``default``."""
        path = Path(path)
        method = _sentence_transformers_pooling(path) or default
        cfg = _read_json(path / "config.json") or {}
        dims = cfg.get("matryoshka_dimensions") or ()
        if not isinstance(dims, list | tuple) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ModelError(f"{path}/config.json: matryoshka_dimensions must be a list of positive integers")
        return cls(method, bool(dims) or bool(cfg.get("is_matryoshka", False)), tuple(dims))

    def check_dimensions(self, dimensions: int, hidden: int) -> None:
        """``dimensions`` (0: the model's own size) is one this model serves, else RequestError."""
        if not dimensions or dimensions == hidden:
            return
        if not self.matryoshka:
            raise RequestError("this model does not support matryoshka representation: `dimensions` "
                               "cannot change its output size")
        if not 0 < dimensions <= hidden or (self.dimensions and dimensions not in self.dimensions):
            sizes = ", ".join(map(str, self.dimensions)) if self.dimensions else f"1 to {hidden}"
            raise RequestError(f"dimensions {dimensions} is not one this model supports ({sizes})")


def _read_json(file: Path) -> dict | list | None:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{file} is not valid JSON: {e}") from None


def _sentence_transformers_pooling(path: Path) -> str | None:
    """The Pooling module's mode in ``modules.json``; None without one."""
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None
    cfg = _read_json(path / str(pooling.get("path", "")) / "config.json") or {}
    modes = [method for key, method in _ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(modes) != 1:
        raise ModelError(f"{path}: pooling {', '.join(others + modes) or 'none'} is not served "
                         f"(one of {', '.join(_ST_MODES)})")
    return modes[0]


class DenseCausalAttention:
    """Attention over the batch's own tokens only (no cache), in the backend interface
    (``engine.attention.base``): the packed rows are padded into ``[B, H, L, D]`` for one SDPA
    call per layer with a causal, length-masked ``[B, 1, L, L]`` mask (sequences of one length:
    a view of the packed rows, plain causal)."""

    name = "dense"

    def __init__(self, scale: float):
        self.scale = scale

    def plan(self, lens: list[int], device: torch.device) -> None:
        self.batch, self.longest, self.total = len(lens), max(lens), sum(lens)
        self.uniform = min(lens) == self.longest  # no padding: a view, plain causal
        if self.uniform:
            return
        starts = [i * self.longest for i in range(len(lens))]
        self.rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]).to(device)
        pos = torch.arange(self.longest, device=device)
        valid = pos.unsqueeze(0) < torch.as_tensor(lens, device=device).unsqueeze(1)  # [B, L] keys
        causal = pos.unsqueeze(0) <= pos.unsqueeze(1)  # [L queries, L keys]
        self.mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # [B, 1, L, L]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.batch * self.longest, *x.shape[1:])
        out.index_copy_(0, self.rows, x)
        return out.view(self.batch, self.longest, *x.shape[1:]).transpose(1, 2)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.uniform:
            b, n = self.batch, self.longest
            o = F.scaled_dot_product_attention(*(x.view(b, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)),
                                               is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2).reshape(q.shape)
        o = F.scaled_dot_product_attention(self._padded(q), self._padded(k), self._padded(v), attn_mask=self.mask,
                                           scale=self.scale, enable_gqa=True)
        flat = o.transpose(1, 2).reshape(self.batch * self.longest, *q.shape[1:])
        return flat.index_select(0, self.rows)


def pool(hidden: torch.Tensor, lens: list[int], method: str) -> torch.Tensor:
    """One float32 vector per sequence of the packed ``hidden [T, H]``, L2-normalised."""
    device = hidden.device
    ends = torch.as_tensor(lens, device=device).cumsum(0)
    if method == "last":
        pooled = hidden.index_select(0, ends - 1).float()
    elif method == "cls":
        pooled = hidden.index_select(0, ends - ends.new_tensor(lens)).float()
    else:
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), ends.new_tensor(lens))
        sums = torch.zeros(len(lens), hidden.shape[1], device=device).index_add_(0, seq, hidden.float())
        pooled = sums / ends.new_tensor(lens).unsqueeze(1)
    return F.normalize(pooled, dim=-1)


def truncate(vectors: torch.Tensor, dimensions: int) -> torch.Tensor:
    """Matryoshka: the first ``dimensions`` of each normalised vector, normalised again (0 or the
    full size: as they are)."""
    if not dimensions or dimensions >= vectors.shape[1]:
        return vectors
    return F.normalize(vectors[:, :dimensions], dim=-1)


class Embedder:
    """The model of ``config`` for embeddings: ``embed(prompts)`` -> ``[N, dim]`` float32 on the CPU.

    Prompts are sorted by length and cut into forwards of at most ``max_num_batched_tokens``
    padded tokens (a prompt longer than that runs alone), so padding stays small and the batch
    size bounded; the caller's order is restored. Runs in the calling thread (a worker calls it
    off its event loop)."""

    def __init__(self, config: EngineConfig, pooling: PoolingConfig):
        self.config, self.pooling = config, pooling
        self.model_config = mc = ModelConfig.from_dir(config.model)
        if mc.mla is not None:  # its dense attention runs per-head K and V
            raise ValueError(f"embeddings are not supported on MLA models ({mc.family}) yet")
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        self.hidden_size = mc.hidden_size
        self.model = load_model(mc, self.device, self.dtype, max_positions=self.max_model_len)
        self.attention = DenseCausalAttention(mc.head_dim**-0.5)
        self.budget = config.max_num_batched_tokens

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def check(self, prompts: list[list[int]], dimensions: int = 0) -> None:
        """RequestError for what this model cannot embed: an empty or too long prompt, a token
        outside the vocabulary, a size it cannot truncate to."""
        self.pooling.check_dimensions(dimensions, self.hidden_size)
        vocab = self.model_config.vocab_size
        for p in prompts:
            if not p or len(p) > self.max_model_len:
                raise RequestError(f"an input of {len(p)} tokens: this model embeds 1 to {self.max_model_len}")
            if max(p) >= vocab or min(p) < 0:
                raise RequestError(f"a token id outside the vocabulary (size {vocab})")

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], dimensions: int = 0) -> torch.Tensor:
        self.check(prompts, dimensions)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = torch.empty(len(prompts), dimensions or self.hidden_size)
        for group in self._groups(order, prompts):
            out[torch.as_tensor(group)] = truncate(self._forward([prompts[i] for i in group]), dimensions).cpu()
        return out

    def _groups(self, order: list[int], prompts: list[list[int]]) -> list[list[int]]:
        """Runs of ``order`` (shortest first) whose padded size fits the token budget."""
        groups: list[list[int]] = []
        for i in order:
            if groups and len(prompts[i]) * (len(groups[-1]) + 1) <= self.budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _forward(self, prompts: list[list[int]]) -> torch.Tensor:
        lens = [len(p) for p in prompts]
        ids = torch.as_tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        self.attention.plan(lens, self.device)
        hidden = self.model.norm(self.model(ids, positions, self.attention))
        return pool(hidden, lens, self.pooling.method)

    def warm_up(self) -> None:
        """One short forward before serving: faults in pages and picks kernels."""
        self.embed([[1, 2, 3], [4, 5]])
