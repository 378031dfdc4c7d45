"""Gradient-norm clipping for a model whose parameters live on several meshes.

``torch.nn.utils.clip_grad_norm_`` cannot combine DTensors from different
meshes (expert parameters on ``ep_fsdp``, the rest on ``fsdp``). Under FSDP2 +
EP every element of every parameter is stored on exactly one rank, so the
global norm is simply the norm over all local shards, reduced over the world.

Cost, as torch's own clipping: one norm kernel per group of gradients of one device and dtype
(``_foreach_norm``) and one scaling kernel per group (``_foreach_mul_``), not one of each per parameter; one
all-reduce; and no host synchronization (the coefficient stays a device tensor).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.compat.torch_internals import foreach_mul_, foreach_norm
from twinkle_strategy.distributed.dtensor import local_tensor


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one device and dtype (a foreach kernel's input), in first-seen order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.device, tensor.dtype)].append(tensor)
    return list(groups.values())


def _norms(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The fp32 ``norm_type`` norm of every non-empty one of ``tensors``, one per tensor, on ``device``."""
    norms = [torch.stack(foreach_norm(group, norm_type)).to(device)
             for group in _by_device_and_dtype([t for t in tensors if t.numel()])]
    return torch.cat(norms) if len(norms) > 1 else norms[0] if norms else torch.zeros(0, device=device)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type`` norm is at most ``max_norm``; return the norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if distributed else 1
    device = local_tensor(grads[0]).device if grads else torch.device("cpu")
    norm_type = float(norm_type)
    # A DTensor gradient's shards are disjoint across ranks; a plain tensor gradient is replicated on every rank.
    sharded = _norms([local_tensor(g) for g in grads if isinstance(g, DTensor)], norm_type, device)
    replicated = _norms([g for g in grads if not isinstance(g, DTensor)], norm_type, device)
    if math.isinf(norm_type):
        total = torch.cat([sharded, replicated, torch.zeros(1, device=device)]).max()
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        # Each group's sum of |g|^p; a replicated gradient counted once over the world.
        total = sharded.pow(norm_type).sum() + replicated.pow(norm_type).sum() / world
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _by_device_and_dtype([local_tensor(g) for g in grads]):
        foreach_mul_(group, coef.to(group[0].device, group[0].dtype))
    return total
