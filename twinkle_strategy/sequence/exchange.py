"""The two all-to-alls of Ulysses, differentiable (their backward is the opposite exchange).

With ``sp`` ranks, a rank holds ``s = S / sp`` tokens of each sequence and all ``H`` heads. Before the
core attention, :func:`sequence_to_heads` gives it the whole sequence for ``H / sp`` heads (head group
``i`` goes to rank ``i`` of the group, sequence chunk ``j`` comes from rank ``j``); after it,
:func:`heads_to_sequence` does the reverse. Only ``all_to_all_single`` with equal splits and
``all_gather_into_tensor`` are used: NCCL, HCCL and gloo all have them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinkle_strategy.moe.dispatch import all_to_all


def _exchange(tensor: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` of ``tensor`` cut in equal blocks along dim 0 (one per rank of ``group``)."""
    splits = [tensor.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
    return all_to_all(tensor, splits, splits, group)


def sequence_to_heads(states: torch.Tensor, group) -> torch.Tensor:
    """[batch, heads, chunk, dim] -> [batch, heads / sp, sequence, dim] (transformers' q/k/v layout)."""
    sp = dist.get_world_size(group)
    batch, heads, chunk, dim = states.shape
    blocks = states.reshape(batch, sp, heads // sp, chunk, dim).transpose(0, 1)  # [sp (head group), b, h/sp, s, d]
    received = _exchange(blocks.contiguous(), group)  # [sp (sequence chunk), b, h/sp, s, d]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // sp, sp * chunk, dim)


def heads_to_sequence(output: torch.Tensor, group) -> torch.Tensor:
    """[batch, sequence, heads / sp, dim] -> [batch, chunk, heads, dim] (the layout attention functions return)."""
    sp = dist.get_world_size(group)
    batch, sequence, heads, dim = output.shape
    blocks = output.reshape(batch, sp, sequence // sp, heads, dim).transpose(0, 1)  # [sp (chunk), b, s, h/sp, d]
    received = _exchange(blocks.contiguous(), group)  # [sp (head group), b, s, h/sp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, sequence // sp, sp * heads, dim)


def gather_sequence(chunk: torch.Tensor, group) -> torch.Tensor:
    """[batch, chunk] -> [batch, sequence]: the chunks of the group side by side (no gradient; position ids)."""
    sp = dist.get_world_size(group)
    gathered = chunk.new_empty((sp * chunk.shape[0], *chunk.shape[1:]))  # the chunks stacked along dim 0
    dist.all_gather_into_tensor(gathered, chunk.contiguous(), group=group)
    return gathered.view(sp, *chunk.shape).permute(1, 0, *range(2, chunk.dim() + 1)).reshape(chunk.shape[0], -1, *chunk.shape[2:])
