"""Token dispatch and combine for expert parallelism.

The router has already decided which experts each token goes to; here we only
move (token, expert) rows to the EP rank that owns the expert, run the model's
own experts forward there on the local experts, and bring the results back.
All movement is ``all_to_all_single`` with uneven splits, wrapped in an
autograd function so gradients take the reverse path.

Two calling contracts (see :mod:`twinkle_strategy.moe.contracts`) share one
core, :func:`run_on_owners`:

* routed (most families): ``experts(hidden_states, top_k_index, top_k_weights)``
  -> :func:`dispatch_routed`; LongCat-Flash's zero-computation experts are
  applied where the token lives and never travel.
* pre-routed (Llama-4): ``experts(routed_in)`` with every token repeated once
  per expert and already scaled by its router score -> :func:`dispatch_pre_routed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from twinkle_strategy.moe.recompute import active_record


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = tensor.new_empty((sum(recv_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _AllToAll.apply(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` on the way back."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def all_to_all(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(tensor, send_splits, recv_splits, group)


@dataclasses.dataclass
class _Exchange:
    """One dispatch's communication results, kept for activation checkpointing's recomputation."""

    send_splits: list[int]
    recv_splits: list[int]
    received: torch.Tensor  # the rows this rank's experts received
    local_expert: torch.Tensor  # their local expert index
    returned: torch.Tensor | None = None  # the expert outputs that came back, one per sent row
    routing: torch.Tensor | None = None  # the router's choices the rows were grouped by


class _Replayed(torch.autograd.Function):
    """An all-to-all already done: the forward returns the recorded result, the backward communicates as
    :class:`_AllToAll`'s does (the gradient still has to travel back)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, recorded: _Exchange, field: str, forward_splits: tuple) -> torch.Tensor:
        send_splits, recv_splits, group = forward_splits
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return getattr(recorded, field).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _AllToAll.apply(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return back, None, None, None


def _send_to_owners(rows: torch.Tensor, row_expert: torch.Tensor, num_local_experts: int,
                    group: dist.ProcessGroup) -> tuple[torch.Tensor, _Exchange]:
    """All-to-all of ``rows`` to the ranks owning ``row_expert``: (received rows with autograd, the exchange)."""
    ep_size = dist.get_world_size(group)
    dest_rank = torch.div(row_expert, num_local_experts, rounding_mode="floor")
    send_counts = torch.bincount(dest_rank, minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    received_rows = all_to_all(rows, send_splits, recv_splits, group)
    with torch.no_grad():
        local_expert = all_to_all(row_expert - dest_rank * num_local_experts, send_splits, recv_splits, group)
    return received_rows, _Exchange(send_splits, recv_splits, received_rows.detach(), local_expert)


def run_on_owners(
    rows: torch.Tensor,
    row_expert: torch.Tensor,
    local_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    num_local_experts: int,
    group: dist.ProcessGroup,
    replay: _Exchange | None = None,
) -> tuple[torch.Tensor, _Exchange]:
    """Expert output for every row of ``rows`` [N, H], computed on the EP rank owning ``row_expert`` [N].

    ``row_expert`` must be sorted ascending (rows grouped by owner).
    ``local_forward(x [M, H], local_expert [M])`` runs this rank's experts on
    the rows it received, one output row per input row. Returns the output and
    the exchange; given the exchange of an earlier identical call (``replay``,
    activation checkpointing's recomputation) nothing is communicated forward.

    Gradient scale: an expert's gradient collects the tokens of all ``ep_size``
    ranks of its EP group, and FSDP then averages it over the ``ep_fsdp``
    group (world / ep ranks), which leaves it ``ep_size`` times the world mean
    that every other parameter gets. We scale the gradient entering the local
    experts by 1/ep and undo it for the gradient leaving them toward the
    tokens, so only the expert parameters see the factor. This keeps FSDP's
    default reduction (no PREMUL_SUM, which gloo and HCCL lack) and is correct
    whatever the size of the ep_fsdp group.
    """
    ep_size = dist.get_world_size(group)
    if replay is None:
        received_rows, exchange = _send_to_owners(rows, row_expert, num_local_experts, group)
    else:
        exchange = replay
        splits = (exchange.send_splits, exchange.recv_splits, group)
        received_rows = _Replayed.apply(rows, exchange, "received", splits)
    local_expert = exchange.local_expert
    received = received_rows.shape[0]
    if received == 0:
        # Run the experts on one zero row anyway: every rank must produce a
        # gradient (zeros) for its expert parameters, or FSDP's reduce-scatter
        # would see different parameter sets on different ranks.
        received_rows = torch.cat([received_rows, received_rows.new_zeros((1,) + tuple(received_rows.shape[1:]))])
        local_expert = torch.zeros(1, dtype=local_expert.dtype, device=local_expert.device)
    received_rows = _ScaleGrad.apply(received_rows, float(ep_size))
    expert_out = local_forward(received_rows, local_expert)
    expert_out = _ScaleGrad.apply(expert_out, 1.0 / ep_size)[:received]
    if replay is not None:
        return _Replayed.apply(expert_out, exchange, "returned", (exchange.recv_splits, exchange.send_splits, group)), \
            exchange
    returned = all_to_all(expert_out, exchange.recv_splits, exchange.send_splits, group)
    exchange.returned = returned.detach()
    return returned, exchange


def _recorded_exchange(routing: torch.Tensor) -> _Exchange | None:
    """In a recomputation, the exchange the original forward recorded for these routing decisions."""
    record = active_record()
    if record is None or not record.replaying:
        return None
    exchange = record.next()
    if not torch.equal(exchange.routing, routing):
        raise RuntimeError("activation checkpointing: the recomputed router chose other experts than the forward "
                           "did (non-deterministic routing); the saved dispatch no longer matches")
    return exchange


def _keep_exchange(exchange: _Exchange, routing: torch.Tensor) -> None:
    """Inside a checkpointed forward, keep the exchange for the recomputation."""
    record = active_record()
    if record is not None and not record.replaying:
        exchange.routing = routing
        record.keep(exchange)


def dispatch_routed(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    num_local_experts: int,
    group: dist.ProcessGroup,
    num_local_zero_experts: int = 0,
    min_top_k: int = 1,
) -> torch.Tensor:
    """Routed expert output for ``hidden_states`` [T, H], computed by the owning EP ranks.

    ``experts_forward(x, local_index, weights)`` is the experts module's own
    forward (with PEFT's LoRA if wrapped), restricted to this rank's experts.
    We give it weight 1 per row and apply the router weights after the return
    trip, so it stays a pure per-row function of the token.

    ``num_experts`` counts the routed experts of every EP rank; indices ``>= num_experts`` are zero-computation (identity) experts
    (LongCat-Flash): their output is the token itself, computed here, so they
    never travel. The (token, expert) rows are combined in ascending expert
    order, as the model's own forward does, so each token's sum adds its terms
    in the same order as a single process.

    Each row reaches the experts forward as a token with one choice. A forward
    that needs ``min_top_k`` choices (LongCat-Flash's) gets extra choices of
    weight 0 on a local identity expert (or, without one, the same expert
    again): they add exactly zero.
    """
    top_k = top_k_index.shape[1]
    flat_expert = top_k_index.reshape(-1)
    # Group (token, expert) pairs by expert, hence by owning rank; identity
    # experts have the largest indices and so come last.
    order = torch.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    num_rows = order.numel()
    # (Counting needs a host sync: only models with identity experts pay for it.)
    num_routed_rows = int((sorted_expert < num_experts).sum()) if num_local_zero_experts else num_rows

    def local_forward(rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        index = local_expert.unsqueeze(-1)
        weights = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
        if min_top_k > 1:
            pad = torch.full_like(index, num_local_experts) if num_local_zero_experts else index
            index = torch.cat([index] + [pad] * (min_top_k - 1), dim=1)
            weights = torch.cat([weights] + [torch.zeros_like(weights)] * (min_top_k - 1), dim=1)
        return experts_forward(rows, index, weights)

    routed_rows = token_of_row[:num_routed_rows]
    replay = _recorded_exchange(top_k_index)
    per_row, exchange = run_on_owners(hidden_states[routed_rows], sorted_expert[:num_routed_rows], local_forward,
                                      num_local_experts=num_local_experts, group=group, replay=replay)
    _keep_exchange(exchange, top_k_index)
    if num_routed_rows < num_rows:
        per_row = torch.cat([per_row, hidden_states[token_of_row[num_routed_rows:]].to(per_row.dtype)])
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    weighted = (per_row * weights).to(hidden_states.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token_of_row, weighted)


def dispatch_pre_routed(
    routed_in: torch.Tensor,
    experts_forward: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    num_local_experts: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Llama-4's contract: ``routed_in`` [E*T, H] holds block e = the T tokens scaled by their score for expert e.

    The block gives every token to every expert, with score 0 for experts the
    router did not choose. A zero row's output is exactly zero (the experts are
    bias-free matmuls around ``up * act(gate)``) and so is its contribution to
    every parameter gradient, so only non-zero rows travel to the expert's
    owner; the others stay zero. The owner runs the module's own forward, which
    wants the same number of rows per local expert: we pad each expert's rows
    with zero rows, whose outputs we drop.
    """
    hidden = routed_in.shape[-1]
    per_expert = routed_in.view(num_experts, -1, hidden)
    with torch.no_grad():
        row_expert, row_token = (per_expert != 0).any(dim=-1).nonzero(as_tuple=True)  # expert-major order

    def local_forward(rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            counts = torch.bincount(local_expert, minlength=num_local_experts)
            width = max(int(counts.max()), 1)
            order = torch.argsort(local_expert, stable=True)
            first_of_expert = torch.cumsum(counts, 0) - counts
            slot = torch.empty_like(order)
            expert_of_sorted = local_expert[order]
            rank_in_expert = torch.arange(order.numel(), device=order.device) - first_of_expert[expert_of_sorted]
            slot[order] = expert_of_sorted * width + rank_in_expert
        padded = rows.new_zeros((num_local_experts * width, hidden)).index_copy(0, slot, rows)
        return experts_forward(padded)[slot]

    replay = _recorded_exchange(row_expert)
    per_row, exchange = run_on_owners(per_expert[row_expert, row_token], row_expert, local_forward,
                                      num_local_experts=num_local_experts, group=group, replay=replay)
    _keep_exchange(exchange, row_expert)
    out = per_row.new_zeros((num_experts, per_expert.shape[1], per_row.shape[-1]))
    return out.index_put((row_expert, row_token), per_row).view(-1, per_row.shape[-1])
