"""The step's sums over ranks: the global loss-token count, a logged value summed or averaged over every rank.

Every front-end (and ``NativeFSDPStrategy.global_loss_tokens`` / ``reduce_sum`` / ``reduce_mean``, which delegate
here) sums through :func:`all_reduce_sum`: without a process group (one process) a sum over ranks is the value itself.

:func:`any_rank` agrees on a host-side flag (a SIGTERM, a refused batch) without the device: its collective runs on
the host (gloo), so reading the answer never waits for the kernels queued before it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from twinkle_strategy.distributed import teardown
from twinkle_strategy.errors import ArgumentTypeError
from twinkle_strategy.sequence.batch import loss_tokens


class DeviceOwner(Protocol):
    """What a sum needs of the strategy: its process group set up (idempotent), and the device its backend's
    collectives take (NCCL, HCCL)."""

    device: torch.device

    def setup(self) -> None: ...


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over every rank, in place (itself without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def global_loss_tokens(*batches: Mapping[str, torch.Tensor], strategy: DeviceOwner) -> torch.Tensor:
    """The tokens a causal LM's loss is taken over in ``batches``, summed over every rank (collective; int64 on
    the strategy's device: exact past 2**24 tokens). A batch's tokens are its ``labels`` that are not -100 after
    the first position, or in a sequence-parallel chunk its ``shift_labels`` that are not -100."""
    for batch in batches:
        if not isinstance(batch, Mapping):
            raise ArgumentTypeError(f"global_loss_tokens takes the batches (dicts with labels, or split_sequence's chunks "
                            f"with shift_labels), not a {type(batch).__name__}: whether a tensor of labels is "
                            "already shifted cannot be told; pass strategy.global_loss_tokens(*micro_batches)")
    strategy.setup()
    count = sum(loss_tokens(batch) for batch in batches)
    return all_reduce_sum(torch.tensor(count, dtype=torch.long).to(strategy.device))


def reduce_sum(value: torch.Tensor, *, strategy: DeviceOwner) -> torch.Tensor:
    """A scalar summed over every rank, detached, in fp32 on the strategy's device (for logging: a step's loss
    from each rank's share)."""
    strategy.setup()
    return all_reduce_sum(value.detach().float().clone().to(strategy.device))


def reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """A scalar averaged over every rank, detached, in fp32 (for logging losses)."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


# The host-side group of each default process group (by identity): made once, on every rank, at the first agreement.
_HOST_GROUPS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup | None]] = {}


def host_group(*, timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """A group of every rank whose collectives take CPU tensors (gloo): the default group where it is gloo already
    (None), else a gloo group made once (collective, on the first call, on every rank alike), as torch DCP's
    async_save keeps one. ``timeout_s``: its collectives' bound (the default group's, so a dead peer is named)."""
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return None
    known = _HOST_GROUPS.get(id(world))
    if known is None or known[0] is not world:
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        known = (world, dist.new_group(backend="gloo", timeout=timeout))
        _HOST_GROUPS[id(world)] = known
        # Destroyed with the process group (torch destroys every group); not kept alive past it by this cache.
        teardown.on_exit(_HOST_GROUPS.clear, what="any_rank's host group")
    return known[1]


def any_rank(flag: bool, *, timeout_s: float | None = None) -> bool:
    """Whether ``flag`` is set on any rank (collective; ``flag`` itself without a process group). A host value in,
    a host value out: the collective runs on the host (:func:`host_group`), never behind the device's queue, so a
    step can agree on it without a device sync (an all-reduce on the device read back with ``.item()`` waits for
    every kernel queued before it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=host_group(timeout_s=timeout_s))
    return bool(value[0])
