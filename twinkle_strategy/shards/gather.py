"""Gathering a sharded, expert-parallel model back into one plain state dict."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import needs_of
from twinkle_strategy.shards.whole_tensors import WholeTensors


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

    Every rank must call this (it is collective). With ``rank0_only`` only global rank 0 receives
    the tensors (each rank sends it its own region: no rank but 0 receives a byte), else every rank
    gets every tensor (all-gathers). ``keys`` restricts the result (e.g. to adapter weights).
    """
    if rank0_only and dist.is_initialized():
        return _gather_on_rank0(model, ep_plan, keys)
    result: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if keys is not None and name not in keys:
            continue
        full = gather_full_tensor(name, value, ep_plan)
        result[name] = _cpu_copy(full)
    return result


def _gather_on_rank0(model: nn.Module, ep_plan: ExpertParallelPlan | None, keys: set[str] | None
                     ) -> dict[str, torch.Tensor]:
    # state_dict(keep_vars=True) holds the parameter and buffer objects themselves: tied weights appear
    # under each of their names, and each is found under the name needs_of knows it by.
    known = {need.name: (need, local) for need, local in needs_of(model, ep_plan)}
    name_of = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    wanted = [(key, *known[name_of[id(value)]]) for key, value in model.state_dict(keep_vars=True).items()
              if keys is None or key in keys]
    table = WholeTensors([need for _, need, _ in wanted], ep_plan, owner=lambda name: 0)
    result: dict[str, torch.Tensor] = {}
    for i, (key, _, local) in enumerate(wanted):
        full = table.gather(i, local.detach())
        if full is not None:
            result[key] = _cpu_copy(full)
    return result


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor the caller owns (``.cpu()`` of a CPU tensor would return the tensor itself)."""
    return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()
