"""Dtype names in one place (the safetensors format's, and the ones users write in recipes and flags), and
:class:`TensorSpec`, a tensor's shape and dtype without its bytes."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from twinkle_strategy.errors import TwinkleError

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's ue8m0 scales
    "C64": torch.complex64,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# What recipes (model.dtype, swift's --torch_dtype) and mixed-precision options call floating dtypes.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def float_dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` for 'bfloat16' or 'bf16', and so on; a clear error for anything else."""
    if name not in FLOAT_DTYPES:
        raise TwinkleError(f"dtype {name!r} is not one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


class TensorSpec(NamedTuple):
    """A tensor's shape and dtype, without its bytes: what planning, checks and file layouts work from."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor) -> TensorSpec:
        """The spec of ``tensor`` (or of anything with a ``shape`` and a ``dtype``: a header entry, a placeholder)."""
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
