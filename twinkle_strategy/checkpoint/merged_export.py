"""A merged export of a LoRA run (``merge_lora``): the base model with its adapters added in, as a checkpoint.

PEFT's own merge (``merge_and_unload``) adds each adapter's delta into its base weight in place. Under FSDP2
that weight is a shard, and with ``quantized_base: keep`` it is a :class:`~twinkle_strategy.quantized.kept.
KeptWeight`, which refuses writes. So the merge here goes one FSDP2 unit at a time:

1. ``unshard()`` the unit: FSDP2 gathers its weights (a kept weight decodes its shard for the all-gather, as it
   does for a forward), so every LoRA layer of the unit sees its whole base weight and whole adapter;
2. each LoRA layer's merged weight is ``base + get_delta_weight()``, PEFT's own delta in the base's dtype (what
   PEFT's ``merge`` adds), of which this rank keeps its FSDP2 rows; ``reshard()`` frees the gathered unit.

Then PEFT's ``unload`` gives back the transformers model (the LoRA layers replaced by their base layers, the
parameters the same FSDP2 ones), each merged weight's shard becomes its merged rows, and
:meth:`NativeFSDPStrategy.save_pretrained <twinkle_strategy.strategy.NativeFSDPStrategy.save_pretrained>`
writes it in the checkpoint's key layout, every rank its own rows. The frozen weights no adapter touched are
written as they are held (a kept one decoded): a plain checkpoint in the model's dtype.

Peak memory: this rank's merged shards (the adapters' targets, in the model dtype) plus one gathered unit.
The export consumes the model (its adapters are merged away): call it once training is done.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.compat.torch_internals import replace_local_tensor


def merge_adapters(peft_model: nn.Module) -> nn.Module:
    """Merge ``peft_model``'s active adapters into its FSDP2 shards (collective) and return the transformers
    model without the adapters. Kept weights (``quantized_base: keep``) are never written: a merged one is
    replaced by a plain shard of its merged values."""
    from peft.tuners.lora import LoraLayer

    merged: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # id(sharded parameter) -> (it, merged rows)
    units = [module for module in peft_model.modules() if isinstance(module, FSDPModule)]
    for unit in reversed(units):  # the root unit last: each nested unit gathers on its own
        sharded = {name: param for name, param in unit.named_parameters()}
        unit.unshard()
        try:
            for name, layer in unit.named_modules():
                if not isinstance(layer, LoraLayer) or not _owned_by(unit, name, units):
                    continue
                for adapter in layer.active_adapters:
                    base_name, base = _base_parameter(layer)
                    full = base + layer.get_delta_weight(adapter)  # what PEFT's merge adds, in the base's dtype
                    param = sharded[f"{name}.{base_name}" if name else base_name]
                    merged[id(param)] = (param, _my_rows(param, full))
        finally:
            unit.reshard()
    model = peft_model.unload()  # the LoRA layers replaced by their base layers: the same parameters
    for param, rows in merged.values():
        replace_local_tensor(param, rows)
    return model


def _owned_by(unit: nn.Module, name: str, units: list[nn.Module]) -> bool:
    """Whether the LoRA layer ``name`` (inside ``unit``) is gathered by ``unit`` rather than a nested unit."""
    parts = name.split(".") if name else []
    return not any(unit.get_submodule(".".join(parts[:i])) in units for i in range(1, len(parts) + 1))


def _base_parameter(layer) -> tuple[str, torch.Tensor]:
    """The weight a LoRA layer adapts: its name under the layer, and the (gathered) tensor.

    ``Linear`` adapts ``base_layer.weight``; an expert ``ParamWrapper`` (``target_parameters``) adapts the
    parameter it names, on its innermost base layer (wrappers of one experts module nest)."""
    parameter_name = getattr(layer, "parameter_name", None)
    if parameter_name is None:
        return "base_layer.weight", layer.get_base_layer().weight
    path, module = "base_layer", layer.base_layer
    while parameter_name not in dict(module.named_parameters(recurse=False)):
        path, module = f"{path}.base_layer", module.base_layer
    return f"{path}.{parameter_name}", getattr(module, parameter_name)


def _my_rows(param, full: torch.Tensor) -> torch.Tensor:
    """This rank's FSDP2 rows of ``full`` (the parameter's whole value on its mesh), as its shard holds them:
    dim 0 in chunks of ``ceil(rows / mesh size)``, the last ones short or empty."""
    local = param.to_local()
    chunk = math.ceil(full.shape[0] / param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * chunk, full.shape[0])
    rows = full[start:start + local.shape[0]].to(local.dtype).contiguous()
    if rows.shape != local.shape:
        raise AssertionError(f"merged rows {tuple(rows.shape)} do not fit the shard {tuple(local.shape)}")
    return rows
