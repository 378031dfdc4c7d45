"""Quantized hub releases: which checkpoint tensors are quantized, where their scales are, and the math.

The largest MoE models ship quantized; every fact about those formats lives here:

* **FP8 blocks** (``quant_method: fp8``; DeepSeek-V3/R1, Kimi-K2, Qwen3 "-FP8"):
  a 2-D projection weight is ``float8_e4m3fn`` with a per-block scale
  ``<name>.weight_scale_inv`` of shape ``[ceil(out / B0), ceil(in / B1)]``
  (float32, bf16, or ue8m0 bytes), ``(B0, B1)`` from ``weight_block_size``.
  Value: ``w[i, j] * s[i // B0, j // B1]``. A block at an edge that does not
  fill ``B`` is simply smaller (DeepSeek-V3's ``weight_dequant``): its scale
  still sits at ``s[i // B0, j // B1]``. (transformers 5.23 infers ``B`` from
  the grid instead, so it fails or goes wrong on such edges.)
* **DeepSeek-V4** (``scale_fmt: ue8m0``): the same FP8 blocks with a
  ``float8_e8m0fnu`` scale named ``<module>.scale``; experts (``expert_dtype:
  fp4``) are int8 bytes each holding two e2m1 FP4 values, low nibble first,
  ``[out, in / 2]``, with a ue8m0 scale ``[out, in / 32]`` (blocks of 1 x 32).
* **MXFP4** (``quant_method: mxfp4``; gpt-oss): ``<name>_blocks`` uint8
  ``[E, out, in / 32, 16]`` and ``<name>_scales`` uint8 ``[E, out, in / 32]``;
  value ``lut[nibble] * 2 ** (scale - 127)``, low nibble first, then laid out
  ``[E, in, out]`` as transformers' ``convert_moe_packed_tensors`` gives it.

:class:`QuantizedIndex` presents such a checkpoint as the checkpoint of its
dequantized values (one float32 tensor per quantized weight, scales hidden),
so :mod:`twinkle_strategy.checkpoint.layout` applies transformers' key rules
to it unchanged; reading rows of a weight reads those quantized rows and only
the scale rows they need (``r0 // B .. ceil(r1 / B)``). :class:`~.codec.Codec`
(the math, in :mod:`.codec`) says how read bytes become values, so that a
rank that never opened the checkpoint can dequantize what its source sends.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
from torch import nn

from twinkle_strategy.compat.transformers_internals import fp8_scale_renamings
from twinkle_strategy.config import QuantizedBase
from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.errors import CheckpointError
from twinkle_strategy.quantized.codec import FP4_GROUP, Codec, StoredAs


class QuantMethod(str, enum.Enum):
    """The ``quant_method`` values of ``quantization_config`` this reader streams."""

    FP8 = "fp8"  # FP8 blocks; DeepSeek-V4's FP8 + FP4 experts
    MXFP4 = "mxfp4"  # gpt-oss


SERVED_METHODS = tuple(method.value for method in QuantMethod)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """What a checkpoint's ``quantization_config`` declares, reduced to what reading it needs."""

    method: QuantMethod
    block: tuple[int, int] | None  # FP8 weight_block_size


def quant_format(config, *, quantized_base: QuantizedBase = QuantizedBase.DEQUANTIZE) -> QuantFormat | None:
    """The served format of ``config``'s ``quantization_config`` (None if not quantized).

    Raises :class:`CheckpointError` naming a format this reader does not serve, before any weight is read,
    with the fix that fits ``quantized_base``.
    """
    spec = getattr(config, "quantization_config", None)
    if not spec:
        return None
    spec = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
    method = str(spec.get("quant_method", "")).lower()
    fix = unserved_format_fix(quantized_base)
    if method not in SERVED_METHODS:
        raise CheckpointError(
            f"the checkpoint is quantized with quant_method '{method}', which memory_efficient_init cannot stream "
            f"(it streams {', '.join(SERVED_METHODS)}: FP8 blocks, DeepSeek-V4 FP8/FP4, MXFP4); {fix}")
    if method == QuantMethod.MXFP4:
        return QuantFormat(QuantMethod.MXFP4, None)
    block = spec.get("weight_block_size")
    if not block or len(block) != 2:
        raise CheckpointError(
            f"the checkpoint is FP8 with weight_block_size {block!r}: only block-scaled FP8 (two block sizes, "
            f"e.g. [128, 128]) streams; {fix}")
    if str(spec.get("fmt", "e4m3")).lower() not in ("e4m3", "e5m2"):
        raise CheckpointError(f"the checkpoint is FP8 with fmt '{spec.get('fmt')}'; only e4m3 and e5m2 stream; {fix}")
    return QuantFormat(QuantMethod.FP8, (int(block[0]), int(block[1])))


def unserved_format_fix(quantized_base: QuantizedBase) -> str:
    """What to do with a release the streamed init cannot serve. Loading it whole (``stream_checkpoint=False``)
    dequantizes it, which ``keep`` cannot be (its bytes reach the ranks only through the streamed init)."""
    if QuantizedBase(quantized_base) == QuantizedBase.KEEP:
        return ("quantized_base=keep holds only FP8-block, DeepSeek-V4 FP8/FP4 and MXFP4 releases as stored; "
                "set quantized_base=dequantize with stream_checkpoint=False to load it whole, or convert it to "
                "bf16 first")
    return "load it whole with NativeFSDPStrategy(..., stream_checkpoint=False) or convert it to bf16 first"


RELEASE_ATTR = "_twinkle_quantized_release"  # set on a model built from a quantized release, on every rank


def drop_quantization_config(config) -> bool:
    """The model built from a quantized release holds dequantized weights: its config says so (as
    transformers' ``dequantize=True``), so a save writes a plain checkpoint. True if there was one."""
    quantized = bool(getattr(config, "quantization_config", None))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return quantized


def mark_quantized_release(model: nn.Module, quantized: bool):
    """Remember on ``model`` that it streams from a quantized release (every rank knows it from the config):
    only then does the init agree on which regions travel as stored, one collective more."""
    setattr(model, RELEASE_ATTR, quantized)
    return model


def is_quantized_release(model: nn.Module) -> bool:
    return bool(getattr(model, RELEASE_ATTR, False))


@dataclasses.dataclass(frozen=True)
class LogicalTensor:
    """A tensor of the dequantized checkpoint: its values' shape and dtype, and what it is read from."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    data_key: str  # the stored tensor (the weight itself when not quantized)
    scale_key: str | None = None
    kind: StoredAs | None = None  # None: stored as it is
    block: tuple[int, int] = (1, 1)

    @property
    def quantized(self) -> bool:
        return self.kind is not None


class QuantizedIndex:
    """A quantized safetensors checkpoint seen as the checkpoint of its dequantized values.

    A :class:`twinkle_strategy.checkpoint.layout.CheckpointIndex` over the stored one (``index``): ``read``
    of a quantized weight returns float32 values, reading only the quantized rows asked for and the
    scale rows they need. Pairs each weight with its scale by transformers'
    FP8 quantizer renames, and checks every pair's shapes before any read.
    """

    def __init__(self, index, fmt: QuantFormat, model: nn.Module | None = None):
        self.stored, self.fmt = index, fmt
        self.tensors: dict[str, LogicalTensor] = {}
        scales = _scale_keys(index, fmt, model)
        companions = set(scales.values()) | {k for k in index.tensors if k.endswith(".activation_scale")}
        for key, stored in index.tensors.items():
            if key in companions:
                continue
            logical = self._logical(key, stored, scales.get(key))
            self.tensors[logical.key] = logical

    def _logical(self, key: str, stored, scale_key: str | None) -> LogicalTensor:
        if self.fmt.method == QuantMethod.MXFP4 and scale_key is not None:
            return self._mxfp4(key, stored, scale_key)
        if scale_key is None:
            if stored.dtype in FP8_DTYPES:
                raise CheckpointError(
                    f"checkpoint tensor '{key}' is {stored.dtype} but its scale ('{key}_scale_inv') is missing "
                    "from the checkpoint; the download is incomplete or the checkpoint is corrupt: download it again")
            return LogicalTensor(key, stored.shape, stored.dtype, key)
        scale = self.stored.tensors[scale_key]
        if stored.dtype == torch.int8 and len(stored.shape) == 2:  # DeepSeek-V4 FP4 experts, two values per byte
            shape, kind, block = (stored.shape[0], 2 * stored.shape[1]), StoredAs.FP4_BLOCK, (1, FP4_GROUP)
        elif stored.dtype in FP8_DTYPES and len(stored.shape) == 2:
            shape, kind, block = stored.shape, StoredAs.FP8_BLOCK, self.fmt.block
        else:
            raise CheckpointError(f"checkpoint tensor '{key}' has a scale ('{scale_key}') but is a {stored.dtype} "
                                  f"tensor of shape {stored.shape}, not a 2-D FP8 or packed FP4 weight")
        want = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
        _check_scale_shape(key, shape, scale_key, scale.shape, want, block)
        return LogicalTensor(key, shape, torch.float32, key, scale_key, kind, block)

    def _mxfp4(self, key: str, stored, scale_key: str) -> LogicalTensor:
        name = key[:-len("_blocks")]
        if stored.dtype != torch.uint8 or len(stored.shape) != 4 or stored.shape[-1] != FP4_GROUP // 2:
            raise CheckpointError(f"checkpoint tensor '{key}' has dtype {stored.dtype} and shape {stored.shape}; "
                                  "MXFP4 blocks are uint8 [experts, out, in / 32, 16]")
        experts, rows, groups, _ = stored.shape
        _check_scale_shape(key, (experts, rows, groups * FP4_GROUP), scale_key, self.stored.tensors[scale_key].shape,
                           (experts, rows, groups), (1, FP4_GROUP))
        return LogicalTensor(name, (experts, groups * FP4_GROUP, rows), torch.float32, key, scale_key, StoredAs.MXFP4)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def bytes_read(self) -> int:
        return self.stored.bytes_read

    @property
    def read_seconds(self) -> float:
        return self.stored.read_seconds

    def close(self) -> None:
        self.stored.close()

    def codec(self, key: str, rows: tuple[int, int] | None = None) -> Codec | None:
        """How rows ``[a, b)`` of ``key`` are stored (None: as they are), from the headers alone."""
        logical = self.tensors[key]
        if not logical.quantized:
            return None
        a, b = rows if rows is not None else (0, logical.shape[0])
        data, scale = self.stored.tensors[logical.data_key], self.stored.tensors[logical.scale_key]
        s0, s1 = _scale_rows(logical, a, b)
        parts = (TensorSpec((b - a,) + data.shape[1:], data.dtype),
                 TensorSpec((s1 - s0,) + scale.shape[1:], scale.dtype))
        return Codec(logical.kind, parts, logical.block, a)

    def read_parts(self, key: str, rows: tuple[int, int] | None = None) -> tuple[Codec | None, list[torch.Tensor]]:
        """What rows ``[a, b)`` of ``key`` are stored as: the read tensors and how to decode them (None: as is)."""
        codec = self.codec(key, rows)
        if codec is None:
            return None, [self.stored.read(key, rows)]
        logical = self.tensors[key]
        a, b = rows if rows is not None else (0, logical.shape[0])
        data = self.stored.read(logical.data_key, (a, b))
        scale = self.stored.read(logical.scale_key, _scale_rows(logical, a, b))
        return codec, [data, scale]

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` of ``key``'s values (float32 for a quantized weight, else as stored)."""
        codec, parts = self.read_parts(key, rows)
        return parts[0] if codec is None else codec.decode(parts)


def _scale_rows(logical: LogicalTensor, a: int, b: int) -> tuple[int, int]:
    """The scale rows that weight rows ``[a, b)`` need: ``a // B0 .. ceil(b / B0)`` (MXFP4: one per expert)."""
    step = 1 if logical.kind == StoredAs.MXFP4 else logical.block[0]
    return a // step, math.ceil(b / step)


def _check_scale_shape(key, shape, scale_key, got, want, block) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(
            f"scale tensor '{scale_key}' has shape {tuple(got)}, but weight '{key}' {tuple(shape)} in blocks of "
            f"{tuple(block)} needs {tuple(want)}; the checkpoint is truncated or corrupt: download it again")


def _scale_keys(index, fmt: QuantFormat, model: nn.Module | None) -> dict[str, str]:
    """Weight key -> its scale key, by the quantizer's own naming (transformers' renames for FP8)."""
    if fmt.method == QuantMethod.MXFP4:
        return {k[:-len("_scales")] + "_blocks": k for k in index.tensors
                if k.endswith("_scales") and k[:-len("_scales")] + "_blocks" in index.tensors}
    renames = fp8_scale_renamings(model)
    out = {}
    for key in index.tensors:
        renamed = key
        for rename in renames:
            renamed, _ = rename.rename_source_key(renamed)
        if renamed.endswith(".weight_scale_inv"):
            out[renamed[:-len("_scale_inv")]] = key
    return {weight: scale for weight, scale in out.items() if weight in index.tensors}
