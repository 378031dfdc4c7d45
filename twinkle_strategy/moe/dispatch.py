"""Token dispatch and combine for expert parallelism.

The router has already chosen ``top_k_index``/``top_k_weights`` for every token;
here we only move tokens to the EP rank that owns each chosen expert, run the
model's own experts forward there on the local experts, and bring the results
back. All movement is ``all_to_all_single`` with uneven splits, wrapped in an
autograd function so gradients take the reverse path.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


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


def dispatch_and_combine(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    local_experts_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    num_local_experts: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Routed expert output for ``hidden_states`` [T, H], computed by the owning EP ranks.

    ``local_experts_forward(x, local_index, weights)`` is the experts module's
    own forward (with PEFT's LoRA if wrapped), restricted to this rank's experts.
    We give it weight 1 per row and apply the router weights after the return
    trip, so it stays a pure per-row function of the token.

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
    num_tokens, top_k = top_k_index.shape
    flat_expert = top_k_index.reshape(-1)
    # Group (token, expert) pairs by expert, hence by owning rank.
    order = torch.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    dest_rank = torch.div(sorted_expert, num_local_experts, rounding_mode="floor")
    send_counts = torch.bincount(dest_rank, minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    tokens = all_to_all(hidden_states[token_of_row], send_splits, recv_splits, group)
    with torch.no_grad():
        local_ids = all_to_all(sorted_expert - dest_rank * num_local_experts, send_splits, recv_splits, group)

    received = tokens.shape[0]
    if received == 0:
        # Run the experts on one zero row anyway: every rank must produce a
        # gradient (zeros) for its expert parameters, or FSDP's reduce-scatter
        # would see different parameter sets on different ranks.
        tokens = torch.cat([tokens, tokens.new_zeros((1,) + tuple(tokens.shape[1:]))])
        local_ids = torch.zeros(1, dtype=local_ids.dtype, device=local_ids.device)
    ones = torch.ones((tokens.shape[0], 1), dtype=top_k_weights.dtype, device=tokens.device)
    tokens = _ScaleGrad.apply(tokens, float(ep_size))
    expert_out = local_experts_forward(tokens, local_ids.unsqueeze(-1), ones)
    expert_out = _ScaleGrad.apply(expert_out, 1.0 / ep_size)[:received]

    returned = all_to_all(expert_out, recv_splits, send_splits, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    weighted = (returned * weights).to(hidden_states.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token_of_row, weighted)
