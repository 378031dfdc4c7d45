"""Moving expert rows between EP ranks: the all-to-alls of expert parallelism, with autograd.

:class:`~twinkle_strategy.moe.parallel_experts.ExpertParallelExperts` reads as the algorithm (route,
dispatch, local expert compute, combine); the two trips are here. :func:`dispatch` sends each
(token, expert) row to the EP rank owning its expert and returns an :class:`ExpertTrip`, the rows this
rank's experts received; :meth:`ExpertTrip.send_back` returns their outputs to the ranks the rows came
from. All movement is ``all_to_all_single`` with uneven splits, wrapped in autograd functions so
gradients take the reverse path.

The rows travel when the experts read them (:class:`~twinkle_strategy.moe.row_source.RowSource`): LoRA on the
experts reads them inside a recomputed region, so they are not kept for the backward but sent again there, one
more all-to-all per layer in place of keeping ``top_k`` rows per token (:mod:`.lora_experts`). Inside activation
checkpointing (:mod:`.recompute`) a trip instead keeps what it communicated, and the recomputation replays it
instead of communicating again.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from twinkle_strategy.moe.recompute import active_record
from twinkle_strategy.moe.row_source import RowSource


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
    """One dispatch's split sizes and, inside a checkpointed forward, what it communicated (kept for the
    recomputation)."""

    send_splits: list[int]
    recv_splits: list[int]
    local_expert: torch.Tensor  # the received rows' local expert index
    received: torch.Tensor | None = None  # the rows this rank's experts received
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


def _exchange_splits(row_expert: torch.Tensor, num_local_experts: int, group: dist.ProcessGroup) -> _Exchange:
    """How many rows go to each rank and come from each (a count exchange, read on the host), and the local
    expert of each row this rank will receive."""
    ep_size = dist.get_world_size(group)
    dest_rank = torch.div(row_expert, num_local_experts, rounding_mode="floor")
    send_counts = torch.bincount(dest_rank, minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    with torch.no_grad():
        local_expert = all_to_all(row_expert - dest_rank * num_local_experts, send_splits, recv_splits, group)
    return _Exchange(send_splits, recv_splits, local_expert)


@dataclasses.dataclass(frozen=True)
class _Arrival:
    """What every received row goes through before the local experts (see :func:`dispatch`)."""

    ep_size: int

    def __call__(self, received_rows: torch.Tensor) -> torch.Tensor:
        if received_rows.shape[0] == 0:
            # Run the experts on one zero row anyway: every rank must produce a
            # gradient (zeros) for its expert parameters, or FSDP's reduce-scatter
            # would see different parameter sets on different ranks.
            received_rows = torch.cat([received_rows,
                                       received_rows.new_zeros((1,) + tuple(received_rows.shape[1:]))])
        return _ScaleGrad.apply(received_rows, float(self.ep_size))


@dataclasses.dataclass(frozen=True)
class _SendOnRead:
    """The read of a :class:`RowSource` whose rows travel when read: the sender's rows, then the all-to-all.

    Read in the forward, and again in the backward where the rows are recomputed rather than kept
    (:func:`~twinkle_strategy.moe.lora_experts.read_with_low_rank`): every rank reads in the same place of the
    same backward, so the all-to-alls pair up. The split sizes are the forward's (no count exchange again).
    """

    sender: RowSource
    exchange: _Exchange
    group: dist.ProcessGroup
    arrival: _Arrival

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        exchange = self.exchange
        rows = all_to_all(self.sender.read(*inputs), exchange.send_splits, exchange.recv_splits, self.group)
        return self.arrival(rows)


@dataclasses.dataclass
class ExpertTrip:
    """Rows at the experts that own them: what this rank's experts compute, and the way back.

    ``rows`` [M, H] reach the local experts with their gradient scaled (see :func:`dispatch`); when no
    row came, ``rows`` is one zero row for local expert 0, whose output :meth:`send_back` drops. Outside
    activation checkpointing they are not yet sent: they travel when read (:class:`RowSource`), so a
    module that recomputes them in the backward sends them again there instead of keeping them.
    """

    rows: RowSource
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


def dispatch(rows: RowSource, row_expert: torch.Tensor, *, num_local_experts: int, group: dist.ProcessGroup,
             routing: torch.Tensor) -> ExpertTrip:
    """Send each row of ``rows`` [N, H] to the EP rank owning its expert ``row_expert`` [N] (sorted ascending:
    rows grouped by owner). ``routing``: the router's choices the rows come from; a recomputation under
    activation checkpointing replays the trip the forward made for them, and refuses other choices.

    The split sizes are exchanged now. The rows themselves travel when the trip's ``rows`` are read, except
    inside a checkpointed forward, whose record keeps the rows received for its recomputation: they travel
    now, and the recomputation replays them.

    Gradient scale: an expert's gradient collects the tokens of all ``ep_size``
    ranks of its EP group, and FSDP then averages it over the ``ep_fsdp``
    group (world / ep ranks), which leaves it ``ep_size`` times the world mean
    that every other parameter gets. We scale the gradient entering the local
    experts by 1/ep and undo it for the gradient leaving them toward the
    tokens (:meth:`ExpertTrip.send_back`), so only the expert parameters see
    the factor. This keeps FSDP's default reduction (no PREMUL_SUM, which gloo
    and HCCL lack) and is correct whatever the size of the ep_fsdp group.
    """
    arrival = _Arrival(dist.get_world_size(group))
    replay = _recorded_exchange(routing)
    if replay is not None:
        exchange = replay
        splits = (exchange.send_splits, exchange.recv_splits, group)
        received = RowSource.of(arrival(_Replayed.apply(rows.read_now(), exchange, "received", splits)))
    else:
        exchange = _exchange_splits(row_expert, num_local_experts, group)
        if not rows_travel_when_read():  # a checkpointed forward: its record keeps what this rank received
            received_rows = all_to_all(rows.read_now(), exchange.send_splits, exchange.recv_splits, group)
            exchange.received = received_rows.detach()
            received = RowSource.of(arrival(received_rows))
        else:
            received = RowSource(inputs=rows.inputs, read=_SendOnRead(rows, exchange, group, arrival),
                                 num_rows=max(sum(exchange.recv_splits), 1))
    local_expert = exchange.local_expert
    num_received = sum(exchange.recv_splits)
    if num_received == 0:
        local_expert = torch.zeros(1, dtype=local_expert.dtype, device=local_expert.device)
    return ExpertTrip(received, local_expert, num_received, exchange, group, routing, replayed=replay is not None)


def rows_travel_when_read() -> bool:
    """Whether a dispatch now leaves its rows to travel when they are read (:func:`dispatch`): everywhere but
    inside a checkpointed forward, whose record keeps the rows received for its recomputation."""
    return active_record() is None


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
