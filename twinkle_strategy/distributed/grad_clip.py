"""Gradient-norm clipping for a model whose parameters live on several meshes.

``torch.nn.utils.clip_grad_norm_`` cannot combine DTensors from different
meshes (expert parameters on ``ep_fsdp``, the rest on ``fsdp``). Under FSDP2 +
EP every element of every parameter is stored on exactly one rank, so the
global norm is simply the norm over all local shards, reduced over the world.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.distributed.dtensor import local_tensor


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type`` norm is at most ``max_norm``; return the norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if distributed else 1
    device = local_tensor(grads[0]).device if grads else torch.device("cpu")
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        total = torch.zeros((), device=device, dtype=torch.float32)
        for g in grads:
            local = local_tensor(g)
            if local.numel():
                total = torch.maximum(total, local.detach().abs().max().float())
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = torch.zeros((), device=device, dtype=torch.float32)
        for g in grads:
            part = torch.linalg.vector_norm(local_tensor(g).detach().float(), norm_type) ** norm_type
            # A plain tensor gradient is replicated on every rank: count it once.
            total += part if isinstance(g, DTensor) else part / world
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef.to(local_tensor(g).dtype))
    return total
