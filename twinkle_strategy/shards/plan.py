"""Which region of which pre-EP tensor each rank keeps: arithmetic over tensor shapes, no process groups.

After ``fully_shard`` every parameter is a DTensor sharded on dim 0 of a 1-D
mesh (``fsdp`` for ordinary tensors, ``ep_fsdp`` for experts), and expert
tensors are already cut to the rank's experts. So a rank's need for one tensor
is: the pre-EP tensor ``name``, cut to EP rank ``ep_rank`` (expert tensors
only), rows ``[start, stop)``. Buffers are needed whole.

A :class:`Region` is such a need with this rank's local rows and the runs of rows of the full tensor they are:
what a save writes and a resume reads back (:mod:`twinkle_strategy.checkpoint.writing`, ``.reading``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan

NOT_EXPERT = -1


@dataclasses.dataclass(frozen=True)
class Need:
    name: str
    ep_rank: int  # NOT_EXPERT for ordinary tensors
    rows: tuple[int, int] | None  # None: the whole tensor
    shape: tuple[int, ...]  # shape of the tensor ``rows`` index: after the EP cut, before FSDP
    dtype: torch.dtype
    is_buffer: bool = False

    @property
    def region_shape(self) -> tuple[int, ...]:
        if self.rows is None:
            return self.shape
        return (self.rows[1] - self.rows[0],) + self.shape[1:]

    @property
    def nbytes(self) -> int:
        return math.prod(self.region_shape) * self.dtype.itemsize


def fsdp_rows(dim0: int, mesh_size: int, mesh_rank: int) -> tuple[int, int]:
    """Rows of dim 0 that FSDP2 gives ``mesh_rank``: ``torch.chunk`` boundaries (ceil-sized chunks)."""
    chunk = math.ceil(dim0 / mesh_size) if dim0 else 0
    start = min(mesh_rank * chunk, dim0)
    return start, min(start + chunk, dim0)


def needs_of(model: nn.Module, ep_plan: ExpertParallelPlan | None) -> list[tuple[Need, torch.Tensor]]:
    """This rank's needs, each with the local tensor its bytes go into, in a fixed order."""
    result: list[tuple[Need, torch.Tensor]] = []
    for name, param in model.named_parameters():
        ep_rank = ep_plan.ep_rank if ep_plan is not None and name in ep_plan.axes else NOT_EXPERT
        if isinstance(param, DTensor):
            if param.device_mesh.ndim != 1 or any(not isinstance(p, Shard) or p.dim != 0 for p in param.placements):
                raise NotImplementedError(
                    f"parameter '{name}' is placed as {param.placements} on a {param.device_mesh.ndim}-D mesh; "
                    "memory_efficient_init supports FSDP2's Shard(0) on a 1-D mesh"
                )
            local = param.to_local()
            rows = fsdp_rows(param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank())
            if local.shape[0] != rows[1] - rows[0]:
                raise AssertionError(f"'{name}': local shard has {local.shape[0]} rows, expected {rows}")
        else:
            local, rows = param.detach(), None
        result.append((Need(name, ep_rank, rows, tuple(param.shape), param.dtype), local))
    for name, buf in model.named_buffers():
        result.append((Need(name, NOT_EXPERT, None, tuple(buf.shape), buf.dtype, is_buffer=True), buf))
    return result


def check_need(need: Need, described: TensorSpec | None,
               ep_plan: ExpertParallelPlan | None, source_rank: int, *,
               dtype_reason: str | None = None) -> str | None:
    """Why the source cannot serve ``need`` from what it holds (``described``: pre-EP shape and dtype), or None.

    ``dtype_reason``: why transformers gave the source's tensor its dtype, if it is not the one requested.
    """
    if described is None:
        return (f"tensor '{need.name}' is not in the model on source rank {source_rank}; every rank must build "
                "the same model (same config, same PEFT adapters) before wrap_model")
    shape, dtype = described
    if need.ep_rank != NOT_EXPERT:
        start, count = ep_plan.local_range(need.name, need.ep_rank)
        shape = ep_plan.axes[need.name].local_shape(shape, count)
    if shape != need.shape:
        return (f"tensor '{need.name}' has shape {shape} on source rank {source_rank} (after the EP cut) "
                f"but the model expects {need.shape}; the checkpoint does not match the config")
    if dtype != need.dtype:
        why = f" ({dtype_reason})" if dtype_reason else ""
        return (f"tensor '{need.name}' is {dtype} on source rank {source_rank} but {need.dtype} in the "
                f"receiving rank's model{why}. Every rank builds the model with the dtypes from_pretrained gives "
                "each tensor (fp32-kept modules included), so they differ only where the model was changed on "
                "some ranks before wrap_model (a .to(dtype), another dtype passed to from_pretrained): make the "
                "same changes on every rank")
    return None


def region_of(tensor: torch.Tensor, need: Need, ep_plan: ExpertParallelPlan | None) -> torch.Tensor:
    """The region of the pre-EP ``tensor`` that ``need`` asks for (a view where the layout allows)."""
    if need.ep_rank != NOT_EXPERT:
        tensor = ep_plan.cut(need.name, tensor, need.ep_rank)
    if need.rows is not None:
        tensor = tensor[need.rows[0]:need.rows[1]]
    return tensor


def checkpoint_runs(need: Need, ep_plan: ExpertParallelPlan | None, full_shape) -> list[tuple[int, int]] | None:
    """Runs of rows ``[a, b)`` of dim 0 of the pre-EP tensor whose concatenation, in order, is ``need``'s region;
    None if the region is not made of whole rows (a scalar, or experts on another dim: PEFT's ``lora_B``).

    An ordinary tensor's shard is one run of rows. So is an expert tensor's when
    the experts are whole blocks of dim 0 (``[E, ...]`` base weights: this
    rank's experts, then FSDP's rows of those); LongCat-Flash's, whose rank also
    keeps its share of the zero-computation slots stored after all routed
    experts, is two. Runs are what let a source read, and a rank write or
    resume, its region of a checkpoint without touching the rest.
    """
    if not full_shape:
        return None
    lo, hi = need.rows if need.rows is not None else (0, need.shape[0])
    if need.ep_rank == NOT_EXPERT:
        return [(lo, hi)]
    axis = ep_plan.axes[need.name]
    if axis.dim != 0:
        return None
    start, count = ep_plan.local_range(need.name, need.ep_rank)
    return axis.row_runs(start, count, lo, hi)


def runs_within(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The runs that make rows ``[lo, hi)`` of the region ``runs`` make (a chunk of a region, as full rows)."""
    out, offset = [], 0
    for a, b in runs:
        first, last = max(lo, offset), min(hi, offset + b - a)
        if first < last:
            out.append((a + first - offset, a + last - offset))
        offset += b - a
    return out


@dataclasses.dataclass(eq=False)
class Region:
    """One tensor this rank keeps part of: what it is, its full shape, and the local rows.

    A region is one run of rows of the full tensor, or a few (LongCat-Flash's zero-computation slots: two); each
    run is written and read as rows. One that is not made of rows (PEFT's expert ``lora_B``) has ``runs=None``
    and goes through its owner rank (:mod:`twinkle_strategy.shards.whole_tensors`).
    """

    need: Need
    local: torch.Tensor  # this rank's rows (the DTensor's local tensor)
    full_shape: tuple[int, ...]  # before EP and FSDP
    runs: list[tuple[int, int]] | None  # the runs of rows of the full tensor it is, in order; None: not rows

    @property
    def name(self) -> str:
        return self.need.name

    @property
    def spec(self) -> TensorSpec:
        """The full (pre-EP, pre-FSDP) tensor's shape and dtype: what the checkpoint holds."""
        return TensorSpec(self.full_shape, self.need.dtype)


def regions_of(model: nn.Module, ep_plan: ExpertParallelPlan | None, names: set[str] | None = None) -> list[Region]:
    """This rank's regions of the model's persistent tensors (``names`` only, if given), in a fixed order."""
    values = dict(model.named_parameters())
    persistent = set(model.state_dict().keys())
    values.update({n: b for n, b in model.named_buffers() if n in persistent})
    regions = []
    for need, local in needs_of(model, ep_plan):
        if need.name not in values or (names is not None and need.name not in names):
            continue
        shape = need.shape
        if ep_plan is not None and need.name in ep_plan.axes:
            axis = ep_plan.axes[need.name]
            shape = axis.local_shape(shape, axis.num_experts)
        runs = checkpoint_runs(need, ep_plan, shape)
        if need.is_buffer:
            runs = None  # every rank has the whole buffer: one rank writes it
        regions.append(Region(need, local, tuple(shape), runs))
    return regions


def partition_regions(regions: list[Region], keep) -> tuple[list[Region], list[Region]]:
    """(regions ``keep`` accepts, the others), each in the original order."""
    kept, others = [], []
    for region in regions:
        (kept if keep(region) else others).append(region)
    return kept, others
