"""Exact per-rank bytes of the model's states: shards, gradients, optimizer state, unsharded units, kept bytes.

Each parameter is cut as the run cuts it: experts to this EP rank's slice (``ExpertAxis``), then
dim 0 into ``mesh`` chunks of ``ceil(rows / mesh)`` rows, padded (FSDP2 pads every rank's shard to
the same size). Experts are sharded over ``ep_fsdp`` (world / ep) ranks, everything else over the
world. Units are those of ``fsdp.apply_fsdp``: each experts module, each decoder layer (without its
experts), and the root (embedding, final norm, head).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from twinkle_strategy.dtypes import FLOAT_DTYPES, kept_parameters, loaded_dtype
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.skeleton import PlannedModel
from twinkle_strategy.quantized.codec import FP4_GROUP
from twinkle_strategy.quantized.formats import QuantFormat, QuantMethod

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each like its parameter's shard
STEP_BYTES = 4  # AdamW's per-parameter step counter (a float32 scalar tensor)


@dataclasses.dataclass(frozen=True)
class UnitBytes:
    """One FSDP2 unit: its name and the bytes it holds while gathered (compute dtype, padded)."""

    name: str
    unsharded: int


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """One rank's model states, in bytes."""

    params: int  # sharded parameters (the frozen base as held: kept quantized bytes under quantized_base=keep)
    params_as_values: int  # the same shards in the model's dtypes (what the init allocates before keeping)
    grads: int  # sharded gradients of the trainable parameters
    optimizer: int  # AdamW states of the trainable parameters
    trainable_params: int  # sharded bytes of the trainable parameters alone
    kept_quantized: int  # of ``params``: frozen weights kept as stored (quantized_base=keep)
    kept_decoded_unit: int  # the largest unit's kept weights decoded (held while it computes)
    buffers: int  # buffers (full copies on every rank)
    root: UnitBytes  # held gathered from the first forward to the end of backward (FSDP2's root)
    layers: tuple[UnitBytes, ...]  # decoder layers, each with its experts
    trainable_count: int  # number of trainable parameter tensors
    total_params: int  # parameters of the whole model (elements)
    trainable_elements: int  # trainable parameters of the whole model (elements)

    @property
    def largest_layer(self) -> int:
        return max((u.unsharded for u in self.layers), default=0)


def padded_rows(rows: int, mesh: int) -> int:
    """Rows each of ``mesh`` ranks holds of a dim-0 sharded tensor (FSDP2 pads to equal chunks)."""
    return math.ceil(rows / mesh)


def _local_shape(name: str, param: torch.Tensor, planned: PlannedModel) -> tuple[int, ...]:
    axis = planned.expert_axes.get(name)
    if axis is None or planned.dims.ep_size == 1:
        return tuple(param.shape)
    count = axis.num_experts // planned.dims.ep_size
    return tuple(axis.cut(torch.empty(param.shape, device="meta"), 0, count).shape)


def _shard_elements(shape: tuple[int, ...], mesh: int) -> int:
    if not shape:
        return 1  # FSDP2 keeps a 0-dim parameter whole on every rank
    return padded_rows(shape[0], mesh) * math.prod(shape[1:])


def _compute_dtype(request: PlanRequest, param: torch.Tensor, kept: set[int]) -> torch.dtype:
    mixed = request.strategy.mixed_precision
    if mixed == "no" or id(param) in kept:
        return param.dtype
    return FLOAT_DTYPES[mixed]


def quantized_bytes(shape: tuple[int, ...], fmt: QuantFormat, *, expert: bool, fp4_experts: bool) -> int:
    """Bytes a frozen weight of ``shape`` (its local slice) holds as stored: values plus scales."""
    elements = math.prod(shape)
    if fmt.method == QuantMethod.MXFP4 or (expert and fp4_experts):
        return elements // 2 + elements // FP4_GROUP  # two e2m1 per byte, one 1-byte scale per 32
    rows = math.prod(shape[:-1])
    b0, b1 = fmt.block
    return elements + math.ceil(rows / b0) * math.ceil(shape[-1] / b1) * 4  # fp8 values, fp32 block scales


def _is_quantized_weight(name: str, param: torch.Tensor) -> bool:
    """The weights a quantized release stores quantized: 2-D/3-D projections, not embeddings, head or router."""
    skip = ("embed", "lm_head", "norm", ".gate.", "mlp.gate.", "router", "lora_")
    return param.dim() >= 2 and not param.requires_grad and not any(s in name for s in skip)


def model_states(planned: PlannedModel, request: PlanRequest) -> ModelStates:
    model, dims = planned.model, planned.dims
    loaded = loaded_dtype(model)
    compute = loaded if request.strategy.mixed_precision == "no" else FLOAT_DTYPES[request.strategy.mixed_precision]
    kept = kept_parameters(model, compute)
    keep_quantized = planned.quantized is not None and request.strategy.quantized_base == "keep"
    fp4_experts = str(getattr(planned.config, "expert_dtype", "")).lower() == "fp4"
    expert_units = {id(block.experts): block.experts_fqn for block in planned.blocks}
    unit_of = _unit_names(model, planned, expert_units)

    params = values = grads = optimizer = trainable_bytes = kept_bytes = count = total = trainable_elements = 0
    unsharded: dict[str, int] = {}
    decoded: dict[str, int] = {}
    for name, param in model.named_parameters():
        local = _local_shape(name, param, planned)
        mesh = dims.ep_fsdp_size if name in planned.expert_axes else dims.world_size
        elements = _shard_elements(local, mesh)
        nbytes = elements * param.element_size()
        total += param.numel()
        values += nbytes
        unit = unit_of(name)
        gathered = (padded_rows(local[0], mesh) * mesh * math.prod(local[1:]) if local else 1)
        if keep_quantized and _is_quantized_weight(name, param):
            stored = quantized_bytes((padded_rows(local[0], mesh), *local[1:]) if local else (1,), planned.quantized,
                                     expert=name in planned.expert_axes, fp4_experts=fp4_experts)
            kept_bytes += stored
            params += stored
            decoded[unit] = decoded.get(unit, 0) + gathered * _compute_dtype(request, param, kept).itemsize
            # A kept weight gathers as stored, then decodes; the decoded copy is counted apart.
            unsharded[unit] = unsharded.get(unit, 0) + stored * mesh
            continue
        params += nbytes
        unsharded[unit] = unsharded.get(unit, 0) + gathered * _compute_dtype(request, param, kept).itemsize
        if param.requires_grad:
            count += 1
            trainable_elements += param.numel()
            trainable_bytes += nbytes
            grads += nbytes
            optimizer += ADAMW_STATES * nbytes + STEP_BYTES
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    layer_units = _layer_units(model, planned, unsharded)
    return ModelStates(params=params, params_as_values=values, grads=grads, optimizer=optimizer, trainable_params=trainable_bytes,
                       kept_quantized=kept_bytes, kept_decoded_unit=max(decoded.values(), default=0),
                       buffers=buffers, root=UnitBytes("root", unsharded.get("", 0)), layers=layer_units,
                       trainable_count=count, total_params=total, trainable_elements=trainable_elements)


def _unit_names(model: nn.Module, planned: PlannedModel, expert_units: dict[int, str]):
    """name of a parameter -> the FSDP2 unit that gathers it: an experts module, a decoder layer, or '' (root)."""
    prefixes: list[str] = []
    layer_ids = {id(layer) for layer in planned.layers}
    for name, module in model.named_modules():
        if id(module) in layer_ids or id(module) in expert_units:
            prefixes.append(name)
    prefixes.sort(key=len, reverse=True)  # an experts module inside a layer wins over its layer

    def unit_of(param_name: str) -> str:
        return next((p for p in prefixes if param_name.startswith(p + ".")), "")

    return unit_of


def _layer_units(model: nn.Module, planned: PlannedModel, unsharded: dict[str, int]) -> tuple[UnitBytes, ...]:
    """Each decoder layer with its experts: what is gathered while that layer computes."""
    names = {id(m): n for n, m in model.named_modules()}
    units = []
    for layer in planned.layers:
        name = names[id(layer)]
        inside = sum(b for unit, b in unsharded.items() if unit == name or unit.startswith(name + "."))
        units.append(UnitBytes(name, inside))
    return tuple(units)
