"""What a weight export sends: each tensor's local rows, the name its checkpoint layout knows it by, its dtype.

Three kinds of export read the same sharded model:

* a full model: every persistent tensor, in the checkpoint's own key layout (transformers' conversions
  reverted, per-expert hub keys), as :meth:`NativeFSDPStrategy.save_pretrained` writes it;
* a LoRA model, merged: the base model's tensors, each weight an adapter modifies replaced by this rank's
  rows of ``base + delta`` (PEFT's own delta, :func:`~twinkle_strategy.checkpoint.merged_export.merged_shards`);
  the model itself is not changed;
* a LoRA model, the adapter alone: the adapter tensors under the keys PEFT's ``save_pretrained`` writes.

Everything here is the same on every rank (names, shapes, dtypes) except the local rows.
"""

from __future__ import annotations

import dataclasses
import enum
import re

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint.layout import CheckpointLayout, SameKeys
from twinkle_strategy.checkpoint.merged_export import merged_shards
from twinkle_strategy.checkpoint.training import is_peft_model
from twinkle_strategy.dtypes import TensorSpec, pretrained_model
from twinkle_strategy.init.skeleton import build_meta_model
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import Region, regions_of


class LoraExport(str, enum.Enum):
    """What a LoRA model's export sends."""

    MERGED = "merged"  # the base weights with the adapters added in: for an engine that does not serve LoRA
    ADAPTER = "adapter"  # the adapter alone, in PEFT's format


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One tensor of an export: this rank's region of it and the name the layout knows it by."""

    region: Region  # the need (under the wrapped model's own name) and this rank's rows
    key: str  # the tensor's name for ``ExportSource.layout`` (a transformers model name, or a PEFT adapter key)
    dtype: torch.dtype  # the dtype it is sent in


@dataclasses.dataclass(frozen=True)
class ExportSource:
    tensors: list[ExportTensor]
    layout: object  # a CheckpointLayout (model tensors -> checkpoint keys) or SameKeys (adapter keys as they are)
    changing: frozenset[str]  # keys whose values training changes between two exports
    release: object = None  # a release-format export: its ReleaseTensors (twinkle_strategy.rl.export_release)


_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")


def base_name(peft_name: str) -> str:
    """The transformers model's name of a PEFT model's base tensor: ``base_model.model.`` and every
    ``.base_layer`` removed (an expert ``ParamWrapper`` nests one per adapted parameter)."""
    return _BASE_LAYER.sub("", peft_name.removeprefix("base_model.model."))


def export_source(model: nn.Module, ep_plan: ExpertParallelPlan | None, *, lora: LoraExport,
                  dtype: torch.dtype | None) -> ExportSource:
    """The tensors ``model`` exports (collective for a merged LoRA export: one FSDP2 unit gathered at a time)."""
    if not is_peft_model(model):
        regions = regions_of(model, ep_plan)
        tensors = [(r, r.name) for r in regions]
        layout_model, changing = model, {n for n, p in model.named_parameters() if p.requires_grad}
    elif lora == LoraExport.ADAPTER:
        return _adapter_source(model, ep_plan, dtype)
    else:
        tensors, changing = _merged_tensors(model, ep_plan)
        layout_model = model.get_base_model()
    layout = CheckpointLayout.for_saving(
        layout_model, {key: TensorSpec(r.full_shape, r.need.dtype) for r, key in tensors})
    engine = engine_dtypes(layout_model, dtype) if dtype is not None else {}
    return ExportSource([ExportTensor(r, key, _sent_dtype(r.need.dtype, dtype, engine.get(key))) for r, key in tensors],
                        layout, frozenset(changing))


def engine_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Model tensor name -> the dtype ``from_pretrained(dtype=dtype)`` gives it (fp32-kept modules, parameters a
    module creates in a fixed dtype such as DeepSeek-V3's router weight): the model's class built on meta."""
    pretrained = pretrained_model(model)
    model_class = next(c for c in type(pretrained).__mro__ if not issubclass(c, FSDPModule))  # not FSDP's subclass
    meta = build_meta_model(model_class, pretrained.config, dtype)
    return {name: tensor.dtype for name, tensor in meta.state_dict(keep_vars=True).items()}


def _sent_dtype(held: torch.dtype, wanted: torch.dtype | None, engine: torch.dtype | None) -> torch.dtype:
    """The engine's dtype for floating tensors (what from_pretrained gives each: routers kept in fp32 stay)."""
    if wanted is None or not held.is_floating_point:
        return held
    return engine if engine is not None and engine.is_floating_point else wanted


def _merged_tensors(model: nn.Module, ep_plan: ExpertParallelPlan | None
                    ) -> tuple[list[tuple[Region, str]], set[str]]:
    with torch.no_grad():
        merged = merged_shards(model)  # id(base weight) -> (it, merged rows), computed before any transfer
    by_name = {id(p): n for n, p in model.named_parameters()}
    rows_of = {by_name[key]: rows for key, (_, rows) in merged.items()}
    tensors = []
    for region in regions_of(model, ep_plan):
        if any(part.startswith("lora_") for part in region.name.split(".")):  # the adapters: merged in already
            continue
        if region.name in rows_of:
            region = dataclasses.replace(region, local=rows_of[region.name])
        tensors.append((region, base_name(region.name)))
    return tensors, {base_name(name) for name in rows_of}


def _adapter_source(model: nn.Module, ep_plan: ExpertParallelPlan | None, dtype: torch.dtype | None
                    ) -> ExportSource:
    """The adapter tensors under PEFT's saved keys (``...q_proj.lora_A.weight``: the adapter's name removed)."""
    from peft.utils import get_peft_model_state_dict

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    params = dict(model.named_parameters())
    named = {id(params[n]): n for n in trainable}
    # PEFT picks and renames the keys it saves; ask it, on the parameter objects, which name each gets.
    saved = get_peft_model_state_dict(model, state_dict={n: params[n] for n in trainable})
    key_of = {named[id(value)]: key for key, value in saved.items() if id(value) in named}
    tensors = [ExportTensor(r, key_of[r.name], _sent_dtype(r.need.dtype, dtype, None))
               for r in regions_of(model, ep_plan, set(key_of))]
    return ExportSource(tensors, SameKeys(), frozenset(t.key for t in tensors))
