"""Moving expert rows between EP ranks: the all-to-alls of expert parallelism, with autograd.

:class:`~twinkle_strategy.moe.parallel_experts.ExpertParallelExperts` reads as the algorithm (route,
dispatch, local expert compute, combine); the two trips are here. :func:`dispatch` sends each
(token, expert) row to the EP rank owning its expert and returns an :class:`ExpertTrip`, the rows this
rank's experts received; :meth:`ExpertTrip.send_back` returns their outputs to the ranks the rows came
from. All movement is ``all_to_all_single`` with uneven splits, wrapped in autograd functions so
gradients take the reverse path.

Inside activation checkpointing (:mod:`.recompute`) a trip keeps what it communicated, and the
recomputation replays it instead of communicating again.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass
class ExpertTrip:
    """Rows at the experts that own them: what this rank's experts compute, and the way back.

    ``rows`` [M, H] reach the local experts with their gradient scaled (see :func:`dispatch`); when no
    row came, ``rows`` is one zero row for local expert 0, whose output :meth:`send_back` drops.
    """

    rows: torch.Tensor
    local_expert: torch.Tensor  # [M]: each row's expert, counted among this rank's experts
    num_received: int
    exchange: _Exchange
    group: dist.ProcessGroup
    routing: torch.Tensor  # the router's choices the rows were grouped by (checked in a recomputation)
    replayed: bool  # a recomputation's trip: nothing is communicated forward

    def send_back(self, expert_out: torch.Tensor) -> torch.Tensor:
        """``expert_out`` (one row per received row) returned to the senders, in the order they sent the rows."""
        exchange, group = self.exchange, self.group
        expert_out = _ScaleGrad.apply(expert_out, 1.0 / dist.get_world_size(group))[:self.num_received]
        if self.replayed:
            return _Replayed.apply(expert_out, exchange, "returned", (exchange.recv_splits, exchange.send_splits, group))
        returned = all_to_all(expert_out, exchange.recv_splits, exchange.send_splits, group)
        exchange.returned = returned.detach()
        _keep_exchange(exchange, self.routing)
        return returned


def dispatch(rows: torch.Tensor, row_expert: torch.Tensor, *, num_local_experts: int, group: dist.ProcessGroup,
             routing: torch.Tensor) -> ExpertTrip:
    """Send each row of ``rows`` [N, H] to the EP rank owning its expert ``row_expert`` [N] (sorted ascending:
    rows grouped by owner). ``routing``: the router's choices the rows come from; a recomputation under
    activation checkpointing replays the trip the forward made for them, and refuses other choices.

    Gradient scale: an expert's gradient collects the tokens of all ``ep_size``
    ranks of its EP group, and FSDP then averages it over the ``ep_fsdp``
    group (world / ep ranks), which leaves it ``ep_size`` times the world mean
    that every other parameter gets. We scale the gradient entering the local
    experts by 1/ep and undo it for the gradient leaving them toward the
    tokens (:meth:`ExpertTrip.send_back`), so only the expert parameters see
    the factor. This keeps FSDP's default reduction (no PREMUL_SUM, which gloo
    and HCCL lack) and is correct whatever the size of the ep_fsdp group.
    """
    ep_size = dist.get_world_size(group)
    replay = _recorded_exchange(routing)
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
    return ExpertTrip(received_rows, local_expert, received, exchange, group, routing, replayed=replay is not None)


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
