"""The dtypes ``from_pretrained`` keeps: which tensors stay in fp32 under which dtype, matched as it matches
them (names against the dtype plan's globs)."""

from __future__ import annotations

import torch

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import (
    CHECKED,
    LOADING_MODULE,
    NO_PUBLIC_API,
    require_on_pretrained_model,
)

DTYPE_PLAN = Internal(
    "PreTrainedModel._get_dtype_plan", "transformers",
    used_for="ask which tensors from_pretrained(dtype=...) keeps in fp32 (which list applies to which dtype), so "
             "that a model built from its config and FSDP2's units give the same dtypes as from_pretrained",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@DTYPE_PLAN.wrapper
def dtype_plan(pretrained, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Name glob -> dtype that ``from_pretrained(dtype=dtype)`` gives the transformers model ``pretrained``."""
    return dict(DTYPE_PLAN.attribute(pretrained, "_get_dtype_plan")(dtype))


KEEP_IN_FP32_STRICT = Internal(
    "PreTrainedModel._keep_in_fp32_modules_strict", "transformers",
    used_for="say, in an error message, which of the model class's lists keeps a tensor in fp32",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@KEEP_IN_FP32_STRICT.wrapper
def keep_in_fp32_strict(pretrained) -> set[str]:
    """The globs ``pretrained``'s class keeps in fp32 under bf16 and fp16 alike."""
    require_on_pretrained_model(KEEP_IN_FP32_STRICT, "_keep_in_fp32_modules_strict")
    return set(getattr(pretrained, "_keep_in_fp32_modules_strict", None) or ())


GLOB_ALTERNATION = Internal(
    "core_model_loading.build_glob_alternation", "transformers",
    used_for="match the dtype plan's globs against tensor names exactly as from_pretrained matches them",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@GLOB_ALTERNATION.wrapper
def glob_alternation(globs: list[str]):
    """``(regex, group name -> glob)``: one alternation of ``globs``, searched in a tensor name; the match's
    ``lastgroup`` names the glob that decides."""
    build = GLOB_ALTERNATION.import_name(LOADING_MODULE, "build_glob_alternation")
    alternation, glob_of_group, *_ = build(list(globs))
    return alternation, glob_of_group
