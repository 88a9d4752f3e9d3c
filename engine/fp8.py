"""FP8 weights in DeepSeek's block-scaled format, for every family the loader reads.

The format (DeepSeek-V3's published checkpoints; Qwen3's FP8 ones use the same scheme): a
linear layer's ``weight`` is ``float8_e4m3fn`` ``[N, K]``, and beside it ``weight_scale_inv``,
float32 ``[ceil(N / bn), ceil(K / bk)]``: the multiplier of each ``bn x bk`` block (edge blocks
are partial when N or K is not a multiple). ``config.json`` says so::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk],
                            "activation_scheme": "dynamic"}

Embeddings, norms, ``lm_head`` and DeepSeek's router stay in high precision.

How the engine runs them. On CPU every FP8 weight is dequantized once, at load, into the
model's dtype, and the layers are the plain ones (oneDNN-packed). The alternative, FP8 weights
resident and dequantized per matmul (``engine.fp8_linear``'s ``dequant`` GEMM), keeps a
quarter of float32's bytes but pays a full dequantization of every weight on every step and
gives up the packed layout that makes CPU decode fast. Measured (2026-12-06, ``small``: 52M
parameters, float32, one thread, a loaded 2-core machine; ``mesh model tiny DIR --size small
[--fp8]``, then one engine per process): load 3-6 s either way (the FP8 file is a third of
the size, its dequantization costs about what the saved reading does); RSS after load +313 MiB
(float32 checkpoint), +313-327 MiB (FP8, dequantized at load), +197 MiB (FP8 resident); decode
at batch 4: 42-66 tok/s (float32), 49-78 (FP8 dequantized at load), 5-6 (FP8 resident). Ten
times slower decode for a third less memory: dequantization at load is the CPU choice.

On a GPU the weights can stay FP8 and run block-scaled FP8 GEMMs (``BlockFp8Gemm``: the
activations quantized per token and 128-column group on the fly, as DeepSeek's
``activation_scheme: dynamic`` says), where the device has such a kernel; elsewhere they are
dequantized at load as on CPU. ``engine.fp8_linear`` holds that part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mesh.errors import ModelError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"  # ``x.weight`` -> ``x.weight_scale_inv``


@dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's ``quantization_config``: FP8 e4m3 weights with a scale per block."""

    block: tuple[int, int]  # (rows, columns) of a scale block

    @classmethod
    def from_config(cls, cfg: dict) -> Fp8Scheme | None:
        """The scheme of a ``config.json`` (None without ``quantization_config``); ModelError for one
        we do not run."""
        q = cfg.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ModelError("quantization_config is not an object")
        method = q.get("quant_method")
        if method != "fp8":
            raise ModelError(f"unsupported quantization {method!r} (supported: fp8, DeepSeek's block-scaled format)")
        fmt, act = q.get("fmt", "e4m3"), q.get("activation_scheme", "dynamic")
        if fmt != "e4m3":
            raise ModelError(f"unsupported FP8 format {fmt!r} (supported: e4m3)")
        if act != "dynamic":
            raise ModelError(f"unsupported FP8 activation_scheme {act!r} (supported: dynamic)")
        block = q.get("weight_block_size")
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelError(f"FP8 weight_block_size must be two positive integers, got {block!r} "
                             "(per-tensor FP8 is not supported)")
        return cls((int(block[0]), int(block[1])))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The ``weight_scale_inv`` shape of a weight of ``shape`` (edge blocks partial)."""
        n, k = shape
        return -(-n // self.block[0]), -(-k // self.block[1])

    def check_scale(self, name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...] | None) -> None:
        """ModelError, one line, for an FP8 weight whose scale tensor is missing or of the wrong shape."""
        if len(shape) != 2:
            raise ModelError(f"FP8 weight {name} has shape {shape}: only 2-D (linear) weights are block-scaled")
        if scale_shape is None:
            raise ModelError(f"FP8 weight {name} has no {scale_name(name)} (its block scales)")
        want = self.scale_shape(shape)
        if tuple(scale_shape) != want:
            raise ModelError(f"{scale_name(name)} has shape {tuple(scale_shape)}, expected {want} for a weight "
                             f"of {shape} in blocks of {self.block[0]}x{self.block[1]}")


Index = tuple[int | slice, ...]


def block_index(index: Index, shape: tuple[int, ...], block: tuple[int, int]) -> Index | None:
    """The part of a weight's scale grid that ``index`` (a part of the weight of ``shape``) covers,
    or None when the part does not fall on block boundaries (its scales would be shared)."""
    out: list[slice] = []
    parts = list(index) + [slice(None)] * (len(shape) - len(index))
    for part, n, b in zip(parts, shape, block, strict=True):
        if not isinstance(part, slice):
            return None
        start, stop, _ = part.indices(n)
        if start % b or (stop % b and stop != n):
            return None
        out.append(slice(start // b, -(-stop // b)))
    return tuple(out)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its elements: ``[N, K]`` float32 (edge blocks cut)."""
    n, k = shape
    return scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 weight ``[N, K]`` back in ``dtype``: each element times its block's scale (in float32)."""
    return (weight.float() * expand_scales(scale_inv, tuple(weight.shape), block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as DeepSeek publishes it: (e4m3 weight, float32 ``weight_scale_inv``), each
    block scaled so that its largest magnitude is e4m3's largest value."""
    w = weight.float()
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = w.new_zeros(rows * block[0], cols * block[1])
    padded[:n, :k] = w
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w / expand_scales(scale_inv, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


def is_quantized_name(name: str) -> bool:
    """Does a writer of DeepSeek's format quantize this checkpoint tensor? The 2-D weights of the
    attention and MLP projections (experts included), not the routers, norms, embeddings or head."""
    if not name.endswith(".weight") or "norm" in name or name.endswith(_ROUTERS):
        return False
    return any(part in name for part in (".self_attn.", ".mlp.", ".block_sparse_moe."))


class Fp8Reader:
    """Reads a checkpoint's FP8 weights: finds each weight's ``weight_scale_inv`` wherever it is
    stored (a sharded checkpoint may put it in another file) and checks it before use. A weight
    whose layer keeps FP8 resident (``resident``: its weight parameter's id -> its scale
    parameter, ``engine.fp8_linear``) is read as stored, its scales placed beside it; any other
    is dequantized into the model's dtype. Plain tensors pass through (``read`` returns None)."""

    def __init__(self, scheme: Fp8Scheme | None, files: list):
        from safetensors import safe_open

        self.scheme = scheme
        self._open = safe_open
        self._scales: dict[str, str] = {}  # scale tensor name -> its file
        self.fp8_names: list[str] = []  # the checkpoint's FP8 tensors
        self.resident: dict[int, torch.Tensor] = {}
        if scheme is not None:
            for file in files:  # headers only
                with safe_open(str(file), framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        if k.endswith(SCALE_SUFFIX):
                            self._scales[k] = str(file)
                        elif f.get_slice(k).get_dtype().startswith("F8"):
                            self.fp8_names.append(k)

    def read(self, f, name: str, part, dtype: torch.dtype) -> torch.Tensor | None:
        """``name`` (open in ``f``, sliced as ``part``) if it is FP8: as stored when ``dtype`` is FP8
        (a resident layer), else dequantized to ``dtype``; None for a plain tensor."""
        kind = part.get_dtype()
        if not kind.startswith("F8"):
            return None
        if kind != "F8_E4M3":
            raise ModelError(f"weight {name} is {kind}: only float8_e4m3fn weights are supported")
        if self.scheme is None:
            raise ModelError(f"weight {name} is float8 but config.json has no quantization_config")
        scale = self._checked_scale(f, name, tuple(part.get_shape()))
        weight = f.get_tensor(name)
        if dtype == FP8_DTYPE:
            return weight
        return dequantize(weight, scale.to(weight.device), self.scheme.block, dtype)

    def place_scales(self, f, name: str, targets: list, loaded: dict[int, int]) -> None:
        """A resident weight's scales into its layer's scale grid, part for part as its ``targets``
        (the loader's) placed the weight (``block_index``: the parts are block-aligned)."""
        scale = self._checked_scale(f, name, targets[0].shape)
        for t in targets:
            grid = self.resident[id(t.param)]
            src = block_index(t.src, t.shape, self.scheme.block)
            dst = block_index(t.dst, tuple(t.param.shape), self.scheme.block)
            part = scale[src].to(grid.device)
            with torch.no_grad():
                grid[dst].copy_(part)
            loaded[id(grid)] = loaded.get(id(grid), 0) + part.numel()

    def _checked_scale(self, f, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        scale = self._scale(f, scale_name(name))
        self.scheme.check_scale(name, shape, None if scale is None else tuple(scale.shape))
        return scale

    def _scale(self, f, name: str) -> torch.Tensor | None:
        file = self._scales.get(name)
        if file is None:
            return None
        if name in f.keys():  # noqa: SIM118 (safe_open is not a mapping): most often beside its weight
            return f.get_tensor(name)
        with self._open(file, framework="pt") as other:
            return other.get_tensor(name)
