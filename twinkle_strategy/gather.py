"""Gathering a sharded, expert-parallel model back into one plain state dict."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.runtime import global_rank


def gather_full_tensor(
    name: str,
    value: torch.Tensor,
    ep_plan: ExpertParallelPlan | None,
) -> torch.Tensor:
    """The whole tensor ``name``: FSDP shards all-gathered, then EP slices joined (collective)."""
    tensor = value.full_tensor() if isinstance(value, DTensor) else value
    if ep_plan is not None and name in ep_plan.axes:
        parts = [torch.empty_like(tensor) for _ in range(ep_plan.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=ep_plan.group)
        tensor = ep_plan.axes[name].join(parts)
    return tensor.detach()


def gather_full_state_dict(
    model: nn.Module,
    ep_plan: ExpertParallelPlan | None,
    *,
    rank0_only: bool = False,
    keys: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """CPU tensors with the keys and shapes of the unsharded model's ``state_dict()``.

    Every rank must call this (it is collective); with ``rank0_only`` only
    global rank 0 keeps the result, so other ranks hold one tensor at a time.
    ``keys`` restricts the result (e.g. to adapter weights).
    """
    keep = not rank0_only or global_rank() == 0
    result: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if keys is not None and name not in keys:
            continue
        full = gather_full_tensor(name, value, ep_plan)
        if keep:
            result[name] = full.cpu().clone() if full.device.type != "cpu" else full.clone()
    return result
