"""EAGLE-3 heads in their published checkpoint format (``LlamaForCausalLMEagle3``: the EAGLE
authors' checkpoints, e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, as vLLM and SGLang load them).

A checkpoint directory holds ``config.json`` and weights (``*.safetensors`` or
``pytorch_model.bin``) under these names:

    fc.weight                      [hidden, n_aux * target_hidden]  fuses the target's auxiliary states
    midlayer.input_layernorm       RMSNorm of the token's embedding
    midlayer.hidden_norm           RMSNorm of the fused hidden state
    midlayer.self_attn.{q,k,v}_proj  input 2 * hidden: [norm(embed), norm(hidden)] concatenated
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight    [draft_vocab, hidden]
    d2t                            [draft_vocab]: target id = draft id + d2t[draft id]
    t2d                            (the reverse map; not needed to draft)
    embed_tokens.weight            optional: the target's embeddings serve when it is absent

The auxiliary states are the inputs of target layers ``eagle_aux_hidden_state_layer_ids`` (top
level or under ``eagle_config``; vLLM's indexing: id j is the residual stream entering layer j, 0
the embeddings), by default (2, L // 2, L - 3) as vLLM chooses them for an L-layer target.

Rebuilding the states of tokens the target did not compute on this worker (``TargetStates``) is a
``RebuildStep``: the target's layers up to the last auxiliary one over those tokens. Under tensor
parallelism every rank runs it (each layer ends in an all-reduce): rank 0 hands it to the helper
ranks as it hands them a step (``engine.parallel``), and keeps the states, which are whole on rank 0.

One step of the head (``Eagle3Head.forward``) at position i takes the token at i + 1 and a hidden
state for position i: the target's fused states (``fc``) for tokens the target computed, the head's
own pre-norm output for the tokens it drafted. It returns the normed output (its logits propose the
next token) and the pre-norm one (the hidden state of the next drafting step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from engine.attention import AttentionBackend, AttentionBatch, create_backend
from engine.config import ModelConfig, RopeConfig
from engine.hostcopy import array_to_device
from engine.kernels import PLAIN
from engine.model import MLP, CausalLM, RMSNorm, Rotary, embedding, pack_cpu_linears
from engine.runner import StepInputs
from kvstore.cache import KVCache

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    path: Path
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    aux_layers: tuple[int, ...]  # the target layers whose inputs the head reads
    norm_before_residual: bool = False  # later checkpoints: the residual is the normed hidden state
    qkv_bias: bool = False

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> Eagle3Config:
        """The checkpoint's config, checked against the target's (ValueError in one line)."""
        path = Path(path)
        cfg = _read_config(path)
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            vocab = int(cfg.get("vocab_size") or target.vocab_size)
            config = cls(
                path=path, hidden_size=hidden, target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
                intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=vocab,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(cfg),
                aux_layers=_aux_layers(cfg, target.num_layers),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"EAGLE-3 checkpoint {path}/config.json is malformed: {type(e).__name__}: {e}") from None
        config.check_target(target)
        return config

    def check_target(self, target: ModelConfig) -> None:
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE-3 checkpoint {self.path} reads target hidden states of size "
                             f"{self.target_hidden_size}, the target's are {target.hidden_size}: it was trained for another model")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 checkpoint {self.path} has a vocabulary of {self.vocab_size} tokens, the target "
                             f"{target.vocab_size}: it was trained for another model")
        bad = [i for i in self.aux_layers if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 checkpoint {self.path} reads layers {bad} of a target with {target.num_layers} layers")


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(f"EAGLE-3 checkpoint directory {path} does not exist")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"EAGLE-3 checkpoint {path} has no readable config.json: {e}") from None
    archs = (cfg.get("architectures") or []) if isinstance(cfg, dict) else []
    if not any(a in ARCHITECTURES for a in archs):
        raise ValueError(f"{path} is not an EAGLE-3 checkpoint (architectures {archs}, expected one of "
                         f"{', '.join(ARCHITECTURES)})")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 checkpoint {path} has {cfg['num_hidden_layers']} layers; the published "
                         "format (one midlayer) is the one supported")
    return cfg


def _aux_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    """The published EAGLE-3 head: ``fc``, one decoder layer over [embedding, hidden], the final norm
    and a draft-vocabulary ``lm_head``. Attention is layer 0 of the backend it is given."""

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding | None, max_positions: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, h, bias=False)
        self.embed_tokens = embed_tokens if embed_tokens is not None else embedding(cfg.vocab_size, h)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.qkv_proj = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(_MlpShape(h, cfg.intermediate_size), _ONE_RANK)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(cfg, max_positions)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, pre-norm)`` outputs ``[T, hidden]`` for tokens ``ids`` at ``positions`` with the
        hidden states of the positions before them (``hidden``, already fused by ``fc``)."""
        T, cfg = ids.shape[0], self.cfg
        embeds = self.input_layernorm(self.embed_tokens(ids))
        if cfg.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        qkv = self.qkv_proj(torch.cat([embeds, hidden], dim=-1)).view(T, -1, cfg.head_dim)
        rope = PLAIN.rope(self.rotary, positions, qkv.dtype)
        q, k = rope.rotate_fused(qkv[:, : cfg.num_heads + cfg.num_kv_heads], cfg.num_heads)
        o = attn.forward(0, q, k, qkv[:, cfg.num_heads + cfg.num_kv_heads:])
        h, residual = self.post_attention_layernorm(self.o_proj(o.reshape(T, self.q_size)), residual)
        return self.norm(self.mlp(h), residual)

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        """The target ids of the greedy draft tokens of ``normed`` rows."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]


@dataclass(frozen=True)
class _MlpShape:  # what engine.model.MLP reads of a config
    hidden_size: int
    intermediate_size: int


class _OneRank:  # engine.tp.Shard's interface, without tensor parallelism
    def part(self, n: int) -> tuple[int, int]:
        return 0, n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


_ONE_RANK = _OneRank()


def load_head(cfg: Eagle3Config, target_embed: nn.Embedding, device: torch.device, dtype: torch.dtype,
              max_positions: int) -> Eagle3Head:
    """The head with the checkpoint's weights (sharing the target's embeddings where it has none)."""
    weights = _read_weights(cfg.path)
    own_embed = "embed_tokens.weight" in weights
    if not own_embed and cfg.hidden_size != target_embed.embedding_dim:
        raise ValueError(f"EAGLE-3 checkpoint {cfg.path} has no embeddings and a hidden size of {cfg.hidden_size}, "
                         f"the target's embeddings are {target_embed.embedding_dim} wide")
    with torch.device(device):
        head = Eagle3Head(cfg, None if own_embed else target_embed, max_positions)
    with torch.no_grad():
        for name, (param, rows) in _checkpoint_names(head, own_embed).items():
            w = weights.get(name)
            if w is None:
                if name == "d2t":  # the draft vocabulary is the target's
                    continue
                raise ValueError(f"EAGLE-3 checkpoint {cfg.path} has no tensor {name}")
            if tuple(w.shape) != tuple(param[rows].shape):
                raise ValueError(f"EAGLE-3 checkpoint {cfg.path}: {name} is {list(w.shape)}, "
                                 f"expected {list(param[rows].shape)}")
            param[rows] = w.to(param.dtype)
    targets = torch.arange(cfg.draft_vocab_size, device=device) + head.d2t
    if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
        raise ValueError(f"EAGLE-3 checkpoint {cfg.path}: d2t maps draft tokens outside the target's vocabulary")
    head = head.to(dtype=dtype).eval()  # d2t, an integer buffer, keeps its dtype
    pack_cpu_linears(head)  # on CPU, as the target's and a draft model's are
    return head


def _checkpoint_names(head: Eagle3Head, own_embed: bool) -> dict[str, tuple[torch.Tensor, slice]]:
    """Checkpoint tensor name -> (our parameter, the rows it fills)."""
    q, kv, inter = head.q_size, head.kv_size, head.cfg.intermediate_size
    every = slice(None)
    names = {
        "fc.weight": (head.fc.weight, every), "norm.weight": (head.norm.weight, every),
        "lm_head.weight": (head.lm_head.weight, every), "d2t": (head.d2t, every),
        "midlayer.input_layernorm.weight": (head.input_layernorm.weight, every),
        "midlayer.hidden_norm.weight": (head.hidden_norm.weight, every),
        "midlayer.post_attention_layernorm.weight": (head.post_attention_layernorm.weight, every),
        "midlayer.self_attn.o_proj.weight": (head.o_proj.weight, every),
        "midlayer.mlp.gate_proj.weight": (head.mlp.gate_up_proj.weight, slice(0, inter)),
        "midlayer.mlp.up_proj.weight": (head.mlp.gate_up_proj.weight, slice(inter, 2 * inter)),
        "midlayer.mlp.down_proj.weight": (head.mlp.down_proj.weight, every),
    }
    parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    for proj, rows in parts.items():
        names[f"midlayer.self_attn.{proj}.weight"] = (head.qkv_proj.weight, rows)
        if head.qkv_proj.bias is not None:
            names[f"midlayer.self_attn.{proj}.bias"] = (head.qkv_proj.bias, rows)
    if own_embed:
        names["embed_tokens.weight"] = (head.embed_tokens.weight, every)
    return names


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by its published name (``model.`` prefixes dropped; the
    layer as ``midlayer.``, which some exports call ``layers.0.``)."""
    files = sorted(path.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            weights.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").is_file():
        weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"EAGLE-3 checkpoint {path} has no weights (*.safetensors or pytorch_model.bin)")
    out = {}
    for name, w in weights.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = w
    return out


# -- the target's states of tokens computed elsewhere ----------------------------------------------

@dataclass(frozen=True)
class RebuildStep:
    """The target's layers up to the last of ``aux_layers`` over ``inputs`` (one sequence's tokens,
    attending to the KV in its blocks; their own keys and values go to a scratch block, so cached
    blocks are never written). What a tensor-parallel helper rank receives in place of a step."""

    inputs: StepInputs
    aux_layers: tuple[int, ...]

    @classmethod
    def of(cls, tokens: list[int], first: int, block_table: list[int], block_size: int, scratch_block: int,
           aux_layers: tuple[int, ...]) -> RebuildStep:
        """Positions ``first``... of ``tokens`` (the sequence's tokens up to the last one rebuilt)."""
        end, count = len(tokens), len(tokens) - first
        inputs = StepInputs(np.asarray(tokens[first:], dtype=np.int64), np.arange(first, end, dtype=np.int64),
                            scratch_block * block_size + np.arange(count, dtype=np.int64) % block_size,
                            [count], [end], [block_table[: -(-end // block_size)]])
        return cls(inputs, aux_layers)


class TargetStates:
    """Runs ``RebuildStep``s on one rank's share of the target: an attention backend of its own
    over that rank's KV (the runner's keeps the plan of the step it runs)."""

    def __init__(self, model: CausalLM, kv: KVCache, backend: str):
        self.model = model
        # the target's scale and (MLA) value dims: K/V attention or latent, as the runner's
        self.attention = configured_backend(backend, kv, model.cfg.attention_scale, model.layers[0].self_attn.num_heads,
                                            model.embed_tokens.weight.dtype, model.cfg.latent_value_dim)
        self.device = model.embed_tokens.weight.device

    @torch.inference_mode()
    def __call__(self, step: RebuildStep) -> torch.Tensor:
        """The auxiliary states ``[T, len(aux_layers) * hidden]`` of the step's tokens (whole on
        every rank: each layer's output is all-reduced)."""
        s = step.inputs
        slots = array_to_device(s.slot_mapping, self.device)
        self.attention.plan(AttentionBatch(s.query_lens, s.context_lens, s.block_tables, slots))
        ids, pos = array_to_device(s.input_ids, self.device), array_to_device(s.positions, self.device)
        _, aux = self.model.forward_aux(ids, pos, self.attention, whole=False, aux_layers=step.aux_layers)
        return aux


def configured_backend(name: str, kv: KVCache, scale: float, num_heads: int, dtype: torch.dtype,
                       value_dim: int = 0) -> AttentionBackend:
    """An attention backend over ``kv`` (``value_dim``: a latent cache's, ``create_backend``'s),
    configured as the runner configures its own (whole steps planned in ``plan()``) where the
    backend can be."""
    attention = create_backend(name, kv, scale, value_dim)
    configure = getattr(attention, "configure", None)
    if configure is not None:
        configure(num_heads, dtype)
    return attention
