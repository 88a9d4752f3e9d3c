"""Multi-head latent attention's dimensions (DeepSeek-V2/V3, Kimi K2), read from a config.

    query:  x -> q_a_proj [q_lora_rank] -> q_a_layernorm -> q_b_proj [heads x (nope + rope)]
            (``q_lora_rank`` null: x -> q_proj [heads x (nope + rope)])
    latent: x -> kv_a_proj_with_mqa [kv_lora_rank + rope] -> the latent (kv_a_layernorm'd) and
            one rope key shared by every head; kv_b_proj [heads x (nope + v)] expands the latent
            into each head's nope key and value

The cache holds ``latent_dim = kv_lora_rank + qk_rope_head_dim`` values per token and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.errors import ModelError


@dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims come in interleaved pairs (DeepSeek's layout)
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj carry biases

    def __post_init__(self) -> None:
        dims = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            dims["q_lora_rank"] = self.q_lora_rank
        bad = [f"{k} {v}" for k, v in dims.items() if v <= 0]
        if bad:
            raise ModelError(f"MLA dimensions must be positive: {', '.join(bad)}")
        if self.qk_rope_head_dim % 2:
            raise ModelError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rope rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        """A head's query and key dims before absorption: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the cache: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> MlaConfig:
        q_lora = cfg.get("q_lora_rank")
        return cls(
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
