"""Expert parallelism for transformers MoE models: slice the experts, route tokens to their owners.

``apply_expert_parallel`` keeps the model's structure and parameter names: each
``experts`` module keeps its expert tensors (``gate_up_proj``/``down_proj``,
``up_proj``, biases, PEFT LoRA), cut down to this rank's experts, and becomes an
:class:`~twinkle_strategy.moe.parallel_experts.ExpertParallelExperts` (the
pre-routed variant for Llama-4, after its call contract, :mod:`.contracts`):
the same instance, its class swapped for a subclass whose ``forward`` dispatches
the router's choices to the owning EP ranks, runs the local experts and combines.
Why a class swap and not a wrapper module: :mod:`.class_swap`. The router itself
is untouched, so routing is exactly the model's own.

Apply PEFT *before* EP: the adapter is then created for all experts, identical
on every rank for a seed, and EP cuts it like the base weights. A saved adapter
is therefore the same full ``[r*E]`` adapter plain PEFT produces. With PEFT the
class swap is on the outermost ``ParamWrapper`` (what the block calls), whose
own forward adds the LoRA deltas around the experts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.errors import ModelStructureError, ParallelConfigError
from twinkle_strategy.moe.class_swap import swap_class
from twinkle_strategy.moe.contracts import CallKind, set_local_expert_counts
from twinkle_strategy.moe.discovery import MoEBlock, find_moe_blocks, model_family, unwrap_experts
from twinkle_strategy.moe.expert_axis import ExpertAxis
from twinkle_strategy.moe.parallel_experts import (
    ExpertParallelExperts,
    ExpertParallelSettings,
    PreRoutedExpertParallelExperts,
)
from twinkle_strategy.parallel import ParallelDims


@dataclasses.dataclass
class ExpertParallelPlan:
    """What EP did to a model: which tensors hold experts and which experts this rank keeps.

    ``axes`` maps the fully qualified name of every expert tensor (as in the
    model's ``state_dict``) to its :class:`ExpertAxis` over *all* experts, so
    any pre-EP tensor can be cut to any rank's slice and gathered slices joined.
    """

    ep_size: int
    ep_rank: int
    axes: dict[str, ExpertAxis]
    experts_modules: list[str]
    # The EP process group the expert slices live in (set by apply_expert_parallel): the plan and its
    # group always travel together, so gathers and saves take one object.
    group: dist.ProcessGroup | None = dataclasses.field(default=None, repr=False, compare=False)

    def local_range(self, name: str, ep_rank: int | None = None) -> tuple[int, int]:
        axis = self.axes[name]
        count = axis.num_experts // self.ep_size
        return (self.ep_rank if ep_rank is None else ep_rank) * count, count

    def cut(self, name: str, full: torch.Tensor, ep_rank: int | None = None) -> torch.Tensor:
        start, count = self.local_range(name, ep_rank)
        return self.axes[name].cut(full, start, count)


def plan_expert_parallel(model: nn.Module, dims: ParallelDims, rank: int) -> tuple[ExpertParallelPlan, list[MoEBlock]]:
    """Find the MoE blocks, check their call contracts and the sizes; changes nothing.

    Pure and identical on every rank (every rank holds the same model
    structure), so a model EP cannot serve raises the same error everywhere
    before any collective.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ModelStructureError(
            f"ep_size={dims.ep_size} but {model_family(model)} has no MoE block (a module with an 'experts' "
            "child); use ep_size=1 for dense models"
        )
    axes = {}
    for block in blocks:
        dims.validate_num_experts(block.num_experts, where=block.experts_fqn)
        zero = block.contract.zero_experts
        if zero % dims.ep_size:
            raise ParallelConfigError(
                f"{block.experts_fqn} has {zero} zero-computation experts, not divisible by ep_size "
                f"{dims.ep_size}: each EP rank stores an equal share of their gate_up_proj slots"
            )
        for t in block.tensors:
            axes[t.fqn] = t.axis
    plan = ExpertParallelPlan(dims.ep_size, dims.ep_rank(rank), axes, [b.experts_fqn for b in blocks])
    return plan, blocks


def apply_expert_parallel(
    model: nn.Module, dims: ParallelDims, rank: int, *, ep_group: dist.ProcessGroup | None
) -> ExpertParallelPlan:
    """Cut every MoE block's experts to this rank's share and dispatch tokens across ``ep_group``.

    Works on real and on meta tensors (memory-efficient init cuts meta tensors
    and fills them later). Fully qualified names in the returned plan are
    relative to ``model``.
    """
    plan, blocks = plan_expert_parallel(model, dims, rank)
    plan.group = ep_group
    for block in blocks:
        local = block.num_experts // dims.ep_size
        start = plan.ep_rank * local
        for t in block.tensors:
            old = getattr(t.module, t.attr)
            # clone(): the slice must not keep the full tensor's storage alive.
            cut = t.axis.cut(old.detach(), start, local).clone()
            setattr(t.module, t.attr, nn.Parameter(cut, requires_grad=old.requires_grad))
        _set_local_expert_count(block, local)
        _make_expert_parallel(block, local, ep_group)
    return plan


def _set_local_expert_count(block: MoEBlock, local: int) -> None:
    inner, wrappers = unwrap_experts(block.experts)
    set_local_expert_counts(inner, block.contract, local)
    for wrapper in wrappers:
        # PEFT reshapes lora_A/lora_B with num_experts (the wrapped parameter's
        # expert slots) in every forward.
        zero = (wrapper.num_experts - block.num_experts) * local // block.num_experts
        wrapper.num_experts = local + zero
        for adapter in wrapper.lora_A:
            rank = wrapper.r[adapter]
            wrapper.lora_A[adapter].out_features = rank * wrapper.num_experts
            wrapper.lora_B[adapter].in_features = rank * wrapper.num_experts


def _make_expert_parallel(block: MoEBlock, num_local: int, group: dist.ProcessGroup | None) -> None:
    """Swap the class of the module the block calls (PEFT's outermost wrapper, or the experts) for its EP subclass."""
    contract = block.contract
    block.experts.expert_parallel = ExpertParallelSettings(
        group=group, num_experts=contract.num_experts, num_local_experts=num_local,
        num_local_zero_experts=contract.zero_experts * num_local // contract.num_experts, min_top_k=contract.min_top_k)
    mixin = PreRoutedExpertParallelExperts if contract.kind == CallKind.PRE_ROUTED else ExpertParallelExperts
    swap_class(block.experts, mixin)
