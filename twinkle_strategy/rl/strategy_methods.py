"""The strategy's methods for reinforcement learning: routing replay, routing records, generation on every rank.

A mixin of :class:`~twinkle_strategy.strategy.NativeFSDPStrategy`, which sets ``self.routing`` (the wrapped
model's :class:`~twinkle_strategy.rl.replay.RoutingHooks`) in ``wrap_model``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.errors import RoutingRecordError
from twinkle_strategy.rl.generation import generate
from twinkle_strategy.rl.record import ROUTED_EXPERTS
from twinkle_strategy.rl.replay import RoutingHooks


class RoutingMethods:
    routing: RoutingHooks | None = None

    def routing_replay(self, record: torch.Tensor, *, input_ids: torch.Tensor):
        """Context: forwards of ``input_ids`` inside dispatch the experts of ``record`` (``routed_experts``,
        ``[*input_ids.shape, MoE layers, top_k]``, -1 where the router may choose), weighted by the current router
        (R3 with a rollout engine's record, R2 with :meth:`routing_record`'s). Collective: a record that does not
        fit raises on every rank; a family that cannot replay raises on every rank (the same model everywhere)."""
        hooks = self._routing_hooks()
        raise_together(hooks.record_problem(record, input_ids), "routing replay", RoutingRecordError)
        return hooks.replaying(record, input_ids=input_ids)

    def routing_record(self):
        """Context yielding a :class:`~twinkle_strategy.rl.RoutingRecorder`: the forwards inside keep what their
        routers chose; ``recorder.routed_experts(like=input_ids)`` is the record to replay."""
        return self._routing_hooks().recording()

    def take_routing_agreement(self) -> list[float] | None:
        """Per MoE layer, the share of replayed tokens whose recorded experts are the ones the router would have
        chosen, since the last call, over every rank (collective); None when nothing was replayed, or (without a
        collective) when the model's routing cannot be replayed."""
        if self.routing is None or self.routing.refusal is not None:
            return None
        return self.routing.take_agreement()

    def generate(self, model: nn.Module, *, input_ids: torch.Tensor, return_routing: bool = False, **kwargs):
        """``model.generate`` on every rank (collective), where some ranks may have no prompt (``input_ids`` of
        zero rows); with ``return_routing``, also the routing record of the sequences (R3 replays it)."""
        return generate(model, self._routing_hooks() if return_routing else self.routing, input_ids=input_ids,
                        return_routing=return_routing, **kwargs)

    def _routing_hooks(self) -> RoutingHooks:
        if self.routing is None:
            raise RuntimeError("routing replay needs the model: call strategy.wrap_model(model) first")
        self.routing.check_served()
        return self.routing


    def replay_of_batch(self, batch: dict):
        """The batch key front-ends pass a record under: ``(batch without routed_experts, context)``, the context
        replaying the record (:meth:`routing_replay`) or doing nothing when the batch has none."""
        if ROUTED_EXPERTS not in batch:
            return batch, contextlib.nullcontext()
        batch = dict(batch)
        record = batch.pop(ROUTED_EXPERTS)
        return batch, self.routing_replay(record, input_ids=batch["input_ids"])
