"""Rotary position embeddings: the frequencies of a config's ``rope_parameters`` (or its older
``rope_theta`` + ``rope_scaling``), in the kinds the supported families use.

    default  theta^(-2i/d)
    linear   default / factor
    llama3   Llama 3's piecewise smoothing of long wavelengths
    yarn     YaRN (DeepSeek-V3 and others): frequencies blended between interpolated and
             extrapolated by a ramp over the dimensions; cos/sin scaled by ``attention_factor``,
             and (DeepSeek's ``mscale_all_dim``) the attention softmax by ``softmax_mscale``

The YaRN formulas follow transformers' ``_compute_yarn_parameters`` and ``yarn_apply_mscale``,
the reference the engine is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mesh.errors import ModelError

ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # -- yarn --
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    explicit_attention_factor: float | None = None  # the config's ``attention_factor``, when it gives one
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> RopeConfig:
        # transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default")) or "default"
        if kind not in ROPE_KINDS:
            raise ModelError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
        max_position = int(cfg.get("max_position_embeddings", 2048))
        if kind == "yarn":
            # a yarn config without these takes them from the context it was trained at
            original = int(merged.get("original_max_position_embeddings") or max_position)
            factor = merged.get("factor") or max_position / original
        else:
            original = int(merged.get("original_max_position_embeddings", 8192))
            factor = merged.get("factor", 1.0)
        optional = {k: float(merged[k]) if merged.get(k) is not None else None
                    for k in ("mscale", "mscale_all_dim", "attention_factor")}
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(factor),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=original,
            beta_fast=float(merged.get("beta_fast") or 32),
            beta_slow=float(merged.get("beta_slow") or 1),
            mscale=optional["mscale"],
            mscale_all_dim=optional["mscale_all_dim"],
            explicit_attention_factor=optional["attention_factor"],
            truncate=bool(merged.get("truncate", True)),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if self.kind == "yarn":
            return self._yarn_inv_freq(head_dim)
        return inv

    def _yarn_inv_freq(self, dim: int) -> torch.Tensor:
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:  # the dimension that turns this often in the context
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the dimension extrapolates (high frequencies), 0: it interpolates
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN; 1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """What the attention softmax scale is multiplied by: DeepSeek's ``mscale_all_dim`` folds YaRN's
        scaling into every dimension of ``q @ k`` (the nope ones too), squared; 1 without it."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


def yarn_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for scales up to 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
