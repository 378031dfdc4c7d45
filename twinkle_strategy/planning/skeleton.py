"""The model a plan measures: built on meta from config.json alone, with LoRA as the run adds it.

The same code the run uses builds it (``init.skeleton.build_meta_model``, PEFT, ``moe.discovery``),
and the sizes are checked as a launch checks them (``ParallelDims``, ``plan_expert_parallel``,
``check_sequence_parallel``): a plan refuses what the launch would refuse, in the same words.
No weight, no index and no process group is touched.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
from torch import nn

from twinkle_strategy.dtypes import float_dtype
from twinkle_strategy.errors import PlanInputError
from twinkle_strategy.fsdp import find_decoder_layers
from twinkle_strategy.init.skeleton import build_meta_model
from twinkle_strategy.loading import config_from_text, model_class_for, read_config_text
from twinkle_strategy.moe.discovery import MoEBlock, find_moe_blocks
from twinkle_strategy.moe.expert_axis import ExpertAxis
from twinkle_strategy.moe.expert_parallel import plan_expert_parallel
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.quantized.formats import QuantFormat, drop_quantization_config, quant_format
from twinkle_strategy.sequence import check_sequence_parallel


@dataclasses.dataclass
class PlannedModel:
    """The meta model of one plan and what the plan reads off it."""

    model: nn.Module  # on meta, LoRA applied as the run applies it
    config: object  # the transformers config built from config.json
    dims: ParallelDims
    blocks: list[MoEBlock]  # the MoE blocks (empty: a dense model)
    expert_axes: dict[str, ExpertAxis]  # fqn of every expert tensor -> its expert axis
    layers: list[nn.Module]  # the decoder layers (FSDP2 units)
    quantized: QuantFormat | None  # the release's format, when it is a quantized one
    notes: list[str]  # what the plan says about the model (dense, quantized ...)

    @property
    def dense(self) -> bool:
        return not self.blocks


def check_sizes(request: PlanRequest, config) -> ParallelDims:
    """The launch's checks of the world against the strategy's sizes and the model's heads."""
    strategy = request.strategy
    dims = ParallelDims(world_size=request.world_size, ep_size=strategy.ep_size, ep_fsdp_size=strategy.ep_fsdp_size,
                        local_world_size=request.nproc_per_node, sp_size=strategy.sequence_parallel_size)
    check_sequence_parallel(config, dims.sp_size)
    return dims


def read_config(request: PlanRequest):
    """The transformers config of ``request.model_path``'s config.json: one line naming the path if it is missing."""
    if not os.path.isfile(request.config_file):
        raise PlanInputError(f"{request.config_file} does not exist: a plan needs the model's config.json; pass the "
                             "directory that holds it (a checkpoint, or a copy of its config.json)")
    return config_from_text(read_config_text(request.model_path), request.config_file)


def build_planned_model(request: PlanRequest) -> PlannedModel:
    config = read_config(request)
    dims = check_sizes(request, config)
    notes: list[str] = []
    quantized = quant_format(config, quantized_base=request.strategy.quantized_base)
    drop_quantization_config(config)  # as every rank builds it: the plain model, weights in the model's dtype
    model = build_meta_model(model_class_for(config), config, float_dtype(request.dtype))
    if request.lora is not None:
        model = _with_lora(model, request)
    blocks = find_moe_blocks(model)
    if dims.ep_enabled or blocks:
        plan_expert_parallel(model, dims, 0) if dims.ep_enabled else None  # the launch's error, word for word
    if not blocks:
        notes.append(f"{type(model).__name__} has no MoE layer (no module with an 'experts' child): planned as a "
                     "dense model")
    if quantized is not None:
        keep = request.strategy.quantized_base == "keep"
        notes.append(f"quantized release ({quantized.method.value}): frozen weights "
                     + ("kept as stored, decoded one unit at a time" if keep else "dequantized into the model dtype"))
    axes = {t.fqn: t.axis for block in blocks for t in block.tensors}
    return PlannedModel(model=model, config=config, dims=dims, blocks=blocks, expert_axes=axes,
                        layers=find_decoder_layers(model), quantized=quantized, notes=notes)


def _with_lora(model: nn.Module, request: PlanRequest) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = request.lora
    modules = list(lora.target_modules)
    targets = [p for p in lora.target_parameters if _has_parameter(model, p)]
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                             target_modules="all-linear" if modules == ["all-linear"] else modules,
                             target_parameters=targets or None)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return get_peft_model(model, peft_config)


def _has_parameter(model: nn.Module, suffix: str) -> bool:
    """PEFT refuses target_parameters a model lacks (a dense model has no experts): plan without them."""
    return any(name.endswith(suffix) for name, _ in model.named_parameters())
