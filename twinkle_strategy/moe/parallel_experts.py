"""The experts module of an MoE block under expert parallelism: route, dispatch, compute locally, combine.

:func:`~twinkle_strategy.moe.expert_parallel.apply_expert_parallel` makes each block's ``experts``
module (the model's own class, or PEFT's outermost ``ParamWrapper`` around it) an
:class:`ExpertParallelExperts` by swapping its class (:mod:`.class_swap`, FSDP2's idiom), so the
instance, its parameters and their names stay the model's. Its ``forward`` is the algorithm:

1. **route**: the router's (token, expert) choices, grouped by expert and so by owning EP rank;
2. **dispatch**: the all-to-all that brings each row to its expert's owner (:func:`.dispatch.dispatch`); the
   split sizes are exchanged here, the rows travel when the local experts read them (a
   :class:`~twinkle_strategy.moe.row_source.RowSource`: LoRA on the activations reads them in a region the
   backward recomputes, sending them again rather than keeping them);
3. **local compute**: :meth:`ExpertParallelExperts.run_local_experts`, this rank's experts on the rows
   they received, through the module's own ``forward`` (PEFT's LoRA included when wrapped): the place
   for LoRA on experts and fused GPU kernels;
4. **combine**: the outputs come back (the reverse all-to-all), weighted by the router and summed per token.

Two call contracts (:mod:`.contracts`) are served: the routed ``experts(hidden_states, top_k_index,
top_k_weights)`` of most families (:class:`ExpertParallelExperts`), with LongCat-Flash's
zero-computation experts applied where the token lives, and Llama-4's pre-routed ``experts(routed_in)``
(:class:`PreRoutedExpertParallelExperts`). The router is not touched, so routing is the model's own.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.moe.dispatch import dispatch
from twinkle_strategy.moe.row_source import ReadsRowSource, RowSource


@dataclasses.dataclass(frozen=True)
class ExpertParallelSettings:
    """What one experts module needs to know of expert parallelism."""

    group: dist.ProcessGroup | None  # the EP group its experts are split over
    num_experts: int  # routed experts of every EP rank together
    num_local_experts: int  # this rank's share: experts [ep_rank * n, (ep_rank + 1) * n)
    num_local_zero_experts: int = 0  # this rank's zero-computation (identity) experts (LongCat-Flash)
    min_top_k: int = 1  # fewest choices per token the module's own forward handles


@dataclasses.dataclass
class RoutedRows:
    """The router's choices as (token, expert) rows, grouped by expert, hence by owning EP rank.

    Identity experts have the largest indices, so their rows come last, after ``num_routed`` rows.
    """

    order: torch.Tensor  # [T*k]: the flat (token, choice) index of each row
    token: torch.Tensor  # [T*k]: the token of each row
    expert: torch.Tensor  # [T*k]: the expert of each row, ascending
    num_routed: int  # rows for routed experts (the others are for identity experts)

    @classmethod
    def of(cls, top_k_index: torch.Tensor, *, num_experts: int, has_identity_experts: bool) -> RoutedRows:
        top_k = top_k_index.shape[1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        expert = flat_expert[order]
        token = torch.div(order, top_k, rounding_mode="floor")
        # (Counting needs a host sync: only models with identity experts pay for it.)
        num_routed = int((expert < num_experts).sum()) if has_identity_experts else order.numel()
        return cls(order, token, expert, num_routed)

    def combine(self, per_row: torch.Tensor, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each token's output: its rows' outputs ``per_row`` (routed rows) weighted by the router and summed.

        Rows are added in ascending expert order, as the model's own forward adds them, so each token's sum
        adds its terms in the same order as a single process. An identity expert's output is the token itself.
        """
        if self.num_routed < self.order.numel():
            per_row = torch.cat([per_row, hidden_states[self.token[self.num_routed:]].to(per_row.dtype)])
        weights = top_k_weights.reshape(-1)[self.order].unsqueeze(-1)
        weighted = (per_row * weights).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, self.token, weighted)


class ExpertParallelExperts(nn.Module):
    """Mixin for an experts module whose experts are split over an EP group (routed contract).

    Never instantiated: :func:`~twinkle_strategy.moe.class_swap.swap_class` puts it in front of the
    module's own class, and :attr:`expert_parallel` is set on the instance.
    """

    expert_parallel: ExpertParallelSettings

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``sum_j w_j * expert_{e_j}(x)`` for every token of ``hidden_states`` [T, H], computed by the owners."""
        ep = self.expert_parallel
        rows = RoutedRows.of(top_k_index, num_experts=ep.num_experts,
                             has_identity_experts=ep.num_local_zero_experts > 0)
        routed = slice(0, rows.num_routed)  # identity experts' rows never travel
        sent = RowSource.of(hidden_states).gather(rows.token[routed])  # one row per (token, choice), read on sending
        trip = dispatch(sent, rows.expert[routed], num_local_experts=ep.num_local_experts, group=ep.group,
                        routing=top_k_index)
        expert_out = self.run_local_experts(trip.rows, trip.local_expert, weights_dtype=top_k_weights.dtype)
        return rows.combine(trip.send_back(expert_out), hidden_states, top_k_weights)

    def run_local_experts(self, rows: RowSource, local_expert: torch.Tensor, *,
                          weights_dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts on the rows they received: one output row per row of ``rows`` [M, H].

        The module's own forward, each row a token with one choice of weight 1: the router's weights are
        applied after the return trip, so the compute stays a pure per-row function of the token. A forward
        that needs ``min_top_k`` choices (LongCat-Flash's) gets extra choices of weight 0 on a local identity
        expert (or, without one, the same expert again): they add exactly zero. A module that takes its rows as a
        :class:`RowSource` (LoRA on the activations, which recomputes them in the backward) gets the source: the
        rows then travel inside its recomputed region. Any other reads them now.
        """
        ep = self.expert_parallel
        index = local_expert.unsqueeze(-1)
        weights = torch.ones((rows.num_rows, 1), dtype=weights_dtype, device=rows.device)
        if ep.min_top_k > 1:
            pad = torch.full_like(index, ep.num_local_experts) if ep.num_local_zero_experts else index
            index = torch.cat([index] + [pad] * (ep.min_top_k - 1), dim=1)
            weights = torch.cat([weights] + [torch.zeros_like(weights)] * (ep.min_top_k - 1), dim=1)
        if isinstance(self, ReadsRowSource):
            return self.forward_reading(rows, index, weights)
        return self.own_forward(rows.read_now(), index, weights)

    def own_forward(self, *args, **kwargs):
        """The module's own ``forward`` (the model's class, or PEFT's ``ParamWrapper`` around it)."""
        return super().forward(*args, **kwargs)

    def extra_repr(self) -> str:
        ep = self.expert_parallel
        shown = f"expert_parallel: {ep.num_local_experts} of {ep.num_experts} experts on this rank"
        own = super().extra_repr()
        return f"{own}, {shown}" if own else shown


class PreRoutedExpertParallelExperts(ExpertParallelExperts):
    """Llama-4's contract: ``routed_in`` [E*T, H] holds block e = the T tokens scaled by their score for expert e.

    The block gives every token to every expert, with score 0 for experts the router did not choose. A zero
    row's output is exactly zero (the experts are bias-free matmuls around ``up * act(gate)``) and so is its
    contribution to every parameter gradient, so only non-zero rows travel to the expert's owner; the others
    stay zero.
    """

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        ep = self.expert_parallel
        per_expert = routed_in.view(ep.num_experts, -1, routed_in.shape[-1])
        with torch.no_grad():  # route: the non-zero rows, expert-major
            row_expert, row_token = (per_expert != 0).any(dim=-1).nonzero(as_tuple=True)
        trip = dispatch(RowSource.of(per_expert[row_expert, row_token]), row_expert,
                        num_local_experts=ep.num_local_experts, group=ep.group, routing=row_expert)
        per_row = trip.send_back(self.run_local_experts(trip.rows, trip.local_expert))
        out = per_row.new_zeros((ep.num_experts, per_expert.shape[1], per_row.shape[-1]))
        return out.index_put((row_expert, row_token), per_row).view(-1, per_row.shape[-1])

    def run_local_experts(self, rows: RowSource, local_expert: torch.Tensor, *,
                          weights_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The module's own forward wants the same number of rows per local expert: each expert's rows are
        padded with zero rows, whose outputs are dropped. (Its module input, the padded rows, is what LoRA's
        gradient reads: the rows are read now.)"""
        rows = rows.read_now()
        num_local = self.expert_parallel.num_local_experts
        with torch.no_grad():
            counts = torch.bincount(local_expert, minlength=num_local)
            width = max(int(counts.max()), 1)
            order = torch.argsort(local_expert, stable=True)
            first_of_expert = torch.cumsum(counts, 0) - counts
            slot = torch.empty_like(order)
            expert_of_sorted = local_expert[order]
            rank_in_expert = torch.arange(order.numel(), device=order.device) - first_of_expert[expert_of_sorted]
            slot[order] = expert_of_sorted * width + rank_in_expert
        padded = rows.new_zeros((num_local * width, rows.shape[-1])).index_copy(0, slot, rows)
        return self.own_forward(padded)[slot]
