"""FSDP2 wrapping: experts on the ep_fsdp mesh, everything else on the flat fsdp mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from twinkle_strategy.dtypes import FLOAT_DTYPES
from twinkle_strategy.parallel import Meshes

_NO_MIXED_PRECISION = {None, "no", "fp32", "float32"}


def mixed_precision_policy(mixed_precision: str | None) -> MixedPrecisionPolicy:
    """Compute in ``mixed_precision`` (bf16/fp16), reduce gradients in fp32; 'no'/'fp32' keeps parameters' dtype."""
    if mixed_precision in _NO_MIXED_PRECISION:
        return MixedPrecisionPolicy()
    if mixed_precision not in FLOAT_DTYPES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported; use 'bf16', 'fp16' or 'no'"
        )
    return MixedPrecisionPolicy(param_dtype=FLOAT_DTYPES[mixed_precision], reduce_dtype=torch.float32)


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found through transformers' ``_no_split_modules``."""
    class_names: set[str] = set()
    for module in model.modules():
        class_names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in class_names]
    if layers:
        return layers
    # Fallback for models without the attribute: children of any ModuleList named "layers".
    return [layer for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)
            for layer in m]


def apply_fsdp(
    model: nn.Module,
    meshes: Meshes,
    experts_modules: list[nn.Module],
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` bottom-up: experts, then each decoder layer, then the root.

    Expert gradients need no special divide factor here: the token dispatch
    already scales them so that FSDP's default mean over ``ep_fsdp`` gives the
    world mean (see :func:`twinkle_strategy.moe.dispatch.run_on_owners`).
    """
    for experts in experts_modules:
        fully_shard(experts, mesh=meshes.ep_fsdp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward)
    for layer in find_decoder_layers(model):
        fully_shard(layer, mesh=meshes.fsdp, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return model
