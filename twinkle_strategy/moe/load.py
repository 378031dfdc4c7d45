"""Counting the tokens each expert of each MoE layer receives, from the router's actual choices.

A forward pre-hook on every ``experts`` module reads the choices the block
passes it (``top_k_index``, or Llama-4's non-zero rows of ``routed_in``), so
the count is the router's real decision whatever the family (group-limited,
biased, hashed routing included) and with or without expert parallelism.
Padding is left out through :attr:`ExpertLoad.token_mask`, and a forward that
activation checkpointing recomputes is not counted again.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.contracts import CallKind
from twinkle_strategy.moe.discovery import find_moe_blocks
from twinkle_strategy.moe.recompute import is_replaying


class ExpertLoad:
    """Tokens per expert per MoE layer, accumulated until :meth:`take_global`.

    ``token_mask``: set to the batch's ``attention_mask`` before a forward so
    that padding is not counted (the blocks flatten [batch, seq] into rows).
    ``active``: counting happens only while True (the trainer turns it off for
    forwards that are not training forwards).
    """

    def __init__(self, model: nn.Module, *, ep_size: int = 1) -> None:
        """``ep_size``: the expert parallelism ``model`` is already cut by (1 before ``wrap_model``)."""
        blocks = find_moe_blocks(model)
        if not blocks:
            raise ModelStructureError(f"{type(model).__name__} has no MoE block: there is no expert load to count")
        sizes = [block.num_experts * ep_size for block in blocks]  # EP leaves each block its local count
        self.num_layers, self.num_experts = len(blocks), max(sizes)
        self.counts: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        self.active = True
        for layer, (block, size) in enumerate(zip(blocks, sizes, strict=False)):
            hook = functools.partial(self._count, layer, block.contract.kind, size)
            block.experts.register_forward_pre_hook(hook, with_kwargs=True)

    def _count(self, layer: int, kind: CallKind, num_experts: int, _module, args, kwargs) -> None:
        if not self.active or is_replaying():
            return
        chosen = _routed_choices(kind, num_experts, args, kwargs)
        with torch.no_grad():
            if self.counts is None:
                self.counts = torch.zeros(self.num_layers, self.num_experts, device=chosen.device)
            weight = torch.ones(chosen.shape, device=chosen.device)
            mask = self.token_mask
            if mask is not None and mask.numel() == chosen.shape[0]:
                weight = weight * mask.reshape(-1, 1).to(weight)
            # LongCat-Flash's identity experts (indices past the routed ones) are not experts to balance: they add a
            # weight of 0 to expert 0. Masked, not selected: selecting (chosen[routed]) makes the device tell the
            # host how many were selected, a host sync in every forward.
            routed = chosen < num_experts
            self.counts[layer].index_add_(0, torch.where(routed, chosen, 0).reshape(-1),
                                          (weight * routed).reshape(-1))

    def take_global(self) -> torch.Tensor:
        """[layers, experts] counts since the last call, summed over every rank (collective); resets."""
        counts = self.counts if self.counts is not None else torch.zeros(self.num_layers, self.num_experts)
        self.counts = None
        if dist.is_initialized():
            dist.all_reduce(counts)
        return counts


def _routed_choices(kind: CallKind, num_experts: int, args: tuple, kwargs: dict) -> torch.Tensor:
    """[tokens, k] expert indices the block hands its experts module in this call."""
    values = list(args) + list(kwargs.values())
    if kind == CallKind.PRE_ROUTED:
        # routed_in [E*T, H]: expert e's block holds the tokens scaled by their score, zero where not chosen.
        per_expert = values[0].view(num_experts, -1, values[0].shape[-1])
        chosen = (per_expert != 0).any(dim=-1)  # [E, T]
        experts = torch.arange(num_experts, device=chosen.device).unsqueeze(-1).expand_as(chosen)
        # A (token, expert) pair not chosen gets an index past the routed experts, so it is not counted.
        return torch.where(chosen, experts, num_experts).T
    return values[1]


def load_imbalance(counts: torch.Tensor) -> float:
    """Over all layers, the largest ratio of one expert's tokens to the layer's mean (1.0 = perfectly even)."""
    mean = counts.float().mean(dim=1, keepdim=True).clamp_min(1e-12)
    return float((counts.float() / mean).max())
