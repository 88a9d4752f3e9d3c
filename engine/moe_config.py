"""A sparse mixture-of-experts MLP's configuration (Mixtral, Qwen2/3-MoE, DeepSeek-V3), read from a config."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.errors import ModelError


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: each token runs ``top_k`` of ``num_experts`` SwiGLU experts.

    ``router`` names how experts are chosen and weighted (``engine.moe.ROUTERS``):
    ``softmax``: softmax over the router logits, top-k, and (``norm_topk_prob``) the k weights
    renormalised to sum to one (Mixtral always renormalises, Qwen2/3-MoE per config);
    ``sigmoid-grouped``: DeepSeek-V3's sigmoid scores, a correction bias for the choice only,
    the best ``topk_groups`` of ``num_groups`` expert groups, weights times
    ``routed_scaling_factor``. ``shared_expert_intermediate_size`` > 0: a dense SwiGLU expert
    every token also runs: Qwen2-MoE's scaled by ``sigmoid(shared_expert_gate(x))``
    (``shared_expert_gated``), DeepSeek's ``n_shared_experts`` experts as one, ungated.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the layers with a sparse MLP; the others are dense
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    router: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.intermediate_size <= 0:
            raise ModelError("the experts' intermediate size must be positive")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ModelError(f"n_group {self.num_groups} must divide n_routed_experts {self.num_experts}")
        per_group = self.num_experts // self.num_groups
        if not 0 < self.topk_groups <= self.num_groups or self.top_k > self.topk_groups * per_group:
            raise ModelError(f"topk_group {self.topk_groups} of n_group {self.num_groups} cannot hold "
                             f"num_experts_per_tok {self.top_k} experts")
        if self.num_groups > 1 and per_group < 2:
            raise ModelError(f"n_group {self.num_groups} leaves fewer than 2 experts per group "
                             "(a group scores by its best two)")

    @classmethod
    def from_hf(cls, cfg: dict, family: str, num_layers: int) -> MoeConfig:
        if family == "deepseek_v3":
            return _deepseek_moe(cls, cfg, num_layers)
        # Qwen checkpoints say num_experts, Mixtral's num_local_experts; transformers 5 may write either
        experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
        if family == "mixtral":
            return cls(
                num_experts=experts,
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=int(cfg["intermediate_size"]),
                norm_topk_prob=True,
                sparse_layers=tuple(range(num_layers)),
            )
        # Qwen2-MoE / Qwen3-MoE: ``decoder_sparse_step`` and ``mlp_only_layers`` leave some layers dense
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return cls(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", family == "qwen3_moe")),
            sparse_layers=sparse,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )


def _deepseek_moe(cls: type[MoeConfig], cfg: dict, num_layers: int) -> MoeConfig:
    """DeepSeek-V3's MoE: the first ``first_k_dense_replace`` layers dense, then every
    ``moe_layer_freq``-th layer sparse; sigmoid scores with a correction bias (``noaux_tc``)."""
    scoring = cfg.get("scoring_func", "sigmoid")
    method = cfg.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ModelError(f"unsupported DeepSeek routing: scoring_func {scoring!r} with topk_method {method!r} "
                         "(supported: sigmoid with noaux_tc, DeepSeek-V3's)")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    inter = int(cfg["moe_intermediate_size"])
    return cls(
        num_experts=int(cfg["n_routed_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        router="sigmoid-grouped",
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )
