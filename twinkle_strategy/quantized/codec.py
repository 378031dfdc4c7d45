"""The math of quantized weights: stored bytes to float32 values (and back, for the test releases), and
:class:`Codec`, how the bytes read for rows of one weight become its values.

The layouts (FP8 blocks, DeepSeek-V4's FP4 experts, gpt-oss MXFP4) are described in :mod:`.formats`, which
reads a release's config and checkpoint; this module knows only tensors. A :class:`Codec` carries no file, so
a rank that never opened the checkpoint dequantizes what its source sends (:mod:`.wire`, :mod:`.kept`).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from twinkle_strategy.dtypes import TensorSpec


class StoredAs(str, enum.Enum):
    """How one quantized weight is stored (what :class:`Codec` decodes)."""

    FP8_BLOCK = "fp8_block"  # float8 values, a scale per block
    FP4_BLOCK = "fp4_block"  # DeepSeek-V4 experts: two e2m1 per byte, a ue8m0 scale per 32 of a row
    MXFP4 = "mxfp4"  # gpt-oss experts: ``_blocks`` and ``_scales``


FP4_GROUP = 32  # DeepSeek-V4 FP4 experts and MXFP4: one scale per 32 values of a row
# e2m1 values by nibble (sign bit 3, then 2 exponent bits and 1 mantissa bit): the OCP MX spec's table.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


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
