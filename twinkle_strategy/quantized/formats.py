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
the scale rows they need (``r0 // B .. ceil(r1 / B)``). :class:`Codec` says
how read bytes become values, so that a rank that never opened the
checkpoint can dequantize what its source sends (``decode``).
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


class QuantMethod(str, enum.Enum):
    """The ``quant_method`` values of ``quantization_config`` this reader streams."""

    FP8 = "fp8"  # FP8 blocks; DeepSeek-V4's FP8 + FP4 experts
    MXFP4 = "mxfp4"  # gpt-oss


class StoredAs(str, enum.Enum):
    """How one quantized weight is stored (what :class:`Codec` decodes)."""

    FP8_BLOCK = "fp8_block"  # float8 values, a scale per block
    FP4_BLOCK = "fp4_block"  # DeepSeek-V4 experts: two e2m1 per byte, a ue8m0 scale per 32 of a row
    MXFP4 = "mxfp4"  # gpt-oss experts: ``_blocks`` and ``_scales``


SERVED_METHODS = tuple(method.value for method in QuantMethod)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_GROUP = 32  # DeepSeek-V4 FP4 experts and MXFP4: one scale per 32 values of a row
# e2m1 values by nibble (sign bit 3, then 2 exponent bits and 1 mantissa bit): the OCP MX spec's table.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


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


# ---------------------------------------------------------------------------------------------- the math
_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """:data:`E2M1_VALUES` on ``device``, copied there once (a decode on a GPU then makes no host copy)."""
    if device not in _E2M1_TABLES:
        _E2M1_TABLES[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return _E2M1_TABLES[device]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values per byte, low nibble first, as float32 twice as wide on the last dim."""
    lut = _e2m1_table(packed.device)
    u8 = packed.contiguous().view(torch.uint8).to(torch.int64)
    values = torch.stack([lut[u8 & 0xF], lut[u8 >> 4]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: ue8m0 (``float8_e8m0fnu`` or its raw bytes) is ``2 ** (byte - 127)``."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def apply_block_scales(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], *,
                       first_row: int = 0) -> torch.Tensor:
    """``values[i, j] * scale[i // B0, j // B1]`` in float32, ``values`` being rows ``first_row..`` of the weight
    and ``scale`` its scale rows from ``first_row // B0`` on. Edge blocks may be smaller than ``B``."""
    out = values.to(torch.float32) if values.dtype != torch.float32 else values.clone()
    return _scale_in_place(out, scale, block, first_row)


def _scale_in_place(out: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], first_row: int) -> torch.Tensor:
    # One block row at a time, in place: no full-size tensor of scales (on CPU, allocating and touching
    # fresh memory costs more than the multiplication). Each value is still one float32 product.
    rows, cols = out.shape[-2:]
    per_col = scale_values(scale).repeat_interleave(block[1], dim=-1)[..., :cols]  # [scale rows, cols]
    if block[0] == 1:  # a scale per row (FP4 experts): one multiplication
        return out.mul_(per_col)
    start = 0
    for index in range(per_col.shape[-2]):
        stop = min(rows, (first_row // block[0] + index + 1) * block[0] - first_row)
        out[..., start:stop, :].mul_(per_col[..., index:index + 1, :])
        start = stop
    return out


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4 ``[E, out, G, 16]`` bytes + ``[E, out, G]`` exponents -> float32 ``[E, in, out]``."""
    values = unpack_e2m1(blocks)  # [E, out, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(1, 2)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int], *, ue8m0: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight and float32 ``weight_scale_inv`` of a 2-D ``weight``, as the releases are made
    (per block: scale = amax / 448; ``ue8m0``: the next power of two, as ``float8_e8m0fnu``, as DeepSeek-V4).
    Edge blocks are smaller, as in DeepSeek-V3."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp(min=1e-12)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    quantized = quantized.reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quantize_fp4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4-style FP4 expert: int8 ``[out, in / 2]`` (two e2m1, low nibble first) and ue8m0 scale
    ``[out, in / 32]``, rounding each value to the nearest e2m1 after a power-of-two scale per 32."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(E2M1_VALUES[:8])
    nibble = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1) | ((scaled < 0).to(torch.int64) << 3)
    nibble = nibble.reshape(rows, cols // 2, 2)
    packed = (nibble[..., 0] | (nibble[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu).reshape(rows, cols // FP4_GROUP)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss MXFP4 of an ``[E, in, out]`` expert weight: uint8 blocks ``[E, out, in / 32, 16]`` and uint8
    exponents ``[E, out, in / 32]`` (the inverse of :func:`mxfp4_values`, to the nearest e2m1)."""
    experts, cols, rows = weight.shape
    packed, scale = quantize_fp4_groups(weight.transpose(1, 2).reshape(experts * rows, cols))
    blocks = packed.view(torch.uint8).reshape(experts, rows, cols // FP4_GROUP, FP4_GROUP // 2)
    return blocks, scale.view(torch.uint8).reshape(experts, rows, cols // FP4_GROUP)


# ------------------------------------------------------------------------------------------ the codecs
@dataclasses.dataclass(frozen=True)
class Codec:
    """How the bytes read for rows of one quantized weight become float32 values (picklable, no file).

    ``parts`` are the tensors read, in order (data, then scale).
    """

    kind: StoredAs
    parts: tuple[TensorSpec, ...]
    block: tuple[int, int] = (1, 1)
    first_row: int = 0

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def split(self, data: torch.Tensor) -> list[torch.Tensor]:
        """``data`` (uint8, the parts end to end) as the parts, without a copy."""
        out, at = [], 0
        for shape, dtype in self.parts:
            size = math.prod(shape) * dtype.itemsize
            piece = data[at:at + size]
            out.append(piece.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype,
                                                                                 device=data.device))
            at += size
        return out

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The float32 values of the rows the parts were read for."""
        data, scale = parts
        if self.kind == StoredAs.MXFP4:
            return mxfp4_values(data, scale)
        values = unpack_e2m1(data) if self.kind == StoredAs.FP4_BLOCK else data.to(torch.float32)
        return _scale_in_place(values, scale, self.block, self.first_row)


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

    A :class:`twinkle_strategy.checkpoint.files.CheckpointIndex` over the stored one (``index``): ``read``
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
