"""DeepSeek-V3's multi-token-prediction (MTP) layer, the head of ``--speculative mtp``
(``engine.mtp_drafter``).

A checkpoint with ``num_nextn_predict_layers`` N > 0 stores N MTP layers after its last decoder
layer, as ``model.layers.{L}...`` (L = ``num_hidden_layers``), in DeepSeek's published naming:

    enorm, hnorm            RMSNorms of the next token's embedding and of a hidden state
    eh_proj                 [hidden, 2 * hidden] over [enorm(embed(token)); hnorm(hidden)]
    self_attn, mlp, input_layernorm, post_attention_layernorm
                            one whole decoder layer (MLA, and DeepSeekMoE where its experts are stored)
    shared_head.norm        the final norm before the logits
    shared_head.head, embed_tokens
                            copies of the model's ``lm_head`` and embeddings: shared, as DeepSeek-V3's
                            report says, so the model's serve (not loaded twice; 1.8 GB each at V3's size)

At position i the layer takes the token at i + 1 and a hidden state for position i (the
target's after its final norm, where the target computed it; the layer's own output before
``shared_head.norm`` for a token it drafted, as vLLM runs it) and proposes the token at i + 2.
The embedding at position 0 is zeroed, as vLLM feeds it. Its attention has KV of its own (one
layer). The loader (``engine.loader.load_mtp_layer``) reads the first MTP layer; a checkpoint with
more drafts with that one for every drafted token, as with one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import PLAIN
from engine.model import CausalLM, DecoderLayer, RMSNorm
from engine.tp import Shard


def check_mtp(mc: ModelConfig, method: str | None) -> None:
    """Refuse ``--speculative mtp`` in one line (ValueError) on a checkpoint with no MTP layer, or
    with an argument; any other method passes."""
    name, colon, _ = (method or "").partition(":")
    if name != "mtp":
        return
    if colon:
        raise ValueError(f"--speculative mtp takes no argument (got {method!r}): the layer is the model's own")
    if mc.mtp_layers > 0:
        return
    if mc.family != "deepseek_v3":
        raise ValueError(f"--speculative mtp drafts with DeepSeek-V3's multi-token-prediction layer: {mc.path} is "
                         f"a {mc.family} checkpoint, which has none (try ngram, draft:DIR or eagle3:DIR)")
    raise ValueError(f"--speculative mtp needs a multi-token-prediction layer: {mc.path} has none "
                     "(num_nextn_predict_layers 0)")


def block_config(cfg: ModelConfig, sparse: bool) -> ModelConfig:
    """The target's config, as the MTP layer's decoder block reads it: its one layer (index 0 of
    its own KV) sparse or dense as the checkpoint stores it."""
    if cfg.moe is None:
        return cfg
    return replace(cfg, moe=replace(cfg.moe, sparse_layers=(0,) if sparse else ()))


class MtpLayer(nn.Module):
    """One MTP layer's own weights; the target's embeddings, rope tables and ``lm_head`` serve
    it (``MtpHead``). ``sparse``: its MLP is DeepSeekMoE's (DeepSeek-V3's is), else dense."""

    def __init__(self, cfg: ModelConfig, sparse: bool):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(block_config(cfg, sparse), 0, Shard())
        self.head_norm = RMSNorm(h, eps)  # shared_head.norm

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rope,
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, pre-norm)`` outputs ``[T, hidden]`` for the embeddings of the tokens at
        ``positions`` and the hidden states of the positions before them."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        h, residual = self.block(x, None, rope, attn)
        return self.head_norm(h, residual)


class MtpHead:
    """The MTP layer with the target's embeddings, rope tables and ``lm_head``: what
    ``engine.state_drafter`` runs (``head(ids, hidden, positions, attention)``, ``draft``)."""

    def __init__(self, layer: MtpLayer, target: CausalLM):
        self.layer = layer
        self.target = target

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 attn) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target
        embeds = target.embed_tokens(ids)
        rope = PLAIN.rope(target.rotary, positions, embeds.dtype)
        return self.layer(embeds, hidden, positions, rope, attn)

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft tokens of ``normed`` rows."""
        return self.target.lm_head(normed).argmax(dim=-1)
