"""The strategy's methods for reinforcement learning: routing replay, routing records, generation on every rank.

:class:`~twinkle_strategy.strategy.NativeFSDPStrategy`'s RL methods call these with ``strategy.routing`` (the
wrapped model's :class:`~twinkle_strategy.rl.replay.RoutingHooks`, set by ``wrap_model``); the strategy imports
this module on the first call, so a run that does no RL loads no module of ``rl/`` but the routing hooks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.errors import CallOrderError, RoutingRecordError
from twinkle_strategy.rl.generation import generate
from twinkle_strategy.rl.record import ROUTED_EXPERTS
from twinkle_strategy.rl.replay import RoutingHooks


def served_hooks(routing: RoutingHooks | None) -> RoutingHooks:
    """``routing``, checked: the model is wrapped and its routers can replay (else one clear error)."""
    if routing is None:
        raise CallOrderError("routing replay needs the model: call strategy.wrap_model(model) first")
    routing.check_served()
    return routing


def routing_replay(routing: RoutingHooks | None, record: torch.Tensor, *, input_ids: torch.Tensor):
    """``NativeFSDPStrategy.routing_replay``: the record checked on every rank, then the replay context."""
    hooks = served_hooks(routing)
    raise_together(hooks.record_problem(record, input_ids), "routing replay", RoutingRecordError)
    return hooks.replaying(record, input_ids=input_ids)


def routing_record(routing: RoutingHooks | None):
    """``NativeFSDPStrategy.routing_record``: the context yielding a :class:`~twinkle_strategy.rl.RoutingRecorder`."""
    return served_hooks(routing).recording()


def take_routing_agreement(routing: RoutingHooks | None) -> list[float] | None:
    """``NativeFSDPStrategy.take_routing_agreement``: None, without a collective, when the model's routing cannot
    be replayed (or no model is wrapped)."""
    if routing is None or routing.refusal is not None:
        return None
    return routing.take_agreement()


def take_routing_agreement_counts(routing: RoutingHooks | None) -> torch.Tensor | None:
    """``NativeFSDPStrategy.take_routing_agreement_counts``: the counts behind :func:`take_routing_agreement`, on
    the device; None, without a collective, when the model's routing cannot be replayed."""
    if routing is None or routing.refusal is not None:
        return None
    return routing.take_agreement_counts()


def generate_on_every_rank(routing: RoutingHooks | None, model: nn.Module, *, input_ids: torch.Tensor,
                           return_routing: bool = False, **kwargs):
    """``NativeFSDPStrategy.generate``: the routing hooks are required only when the routing is returned."""
    return generate(model, served_hooks(routing) if return_routing else routing, input_ids=input_ids,
                    return_routing=return_routing, **kwargs)


def replay_of_batch(routing: RoutingHooks | None, batch: dict):
    """``NativeFSDPStrategy.replay_of_batch``: ``(batch without routed_experts, context)``, the context replaying
    the batch's record, or doing nothing when the batch has none."""
    if ROUTED_EXPERTS not in batch:
        return batch, contextlib.nullcontext()
    batch = dict(batch)
    record = batch.pop(ROUTED_EXPERTS)
    return batch, routing_replay(routing, record, input_ids=batch["input_ids"])
