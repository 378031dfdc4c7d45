"""A training forward of the step, the same for every front-end: replay, the global-batch aux-loss share, and what
backward takes.

:func:`forward_share` runs a front-end's own forward (twinkle's ``model(**batch)``, the ``transformers.Trainer``'s
``compute_loss`` and so TRL's and swift's) on a micro-batch of the step:

* a routing record in the batch (``routed_experts``) is replayed by the forward (R2/R3), and the backward, later,
  recomputes checkpointed layers with it too (:mod:`twinkle_strategy.rl.replay`);
* with a global-batch load-balancing loss (:class:`~twinkle_strategy.moe.balance.GlobalBatchAuxLoss`), the router
  logits are read off the first forward's backbone (TRL's fused forwards do not return them; its later forwards in
  ``compute_loss`` are gradient-free, for metrics), and the forward's share of the step's aux loss is taken against
  the step's global router statistics (under replay: of the experts the forward used).

:meth:`ForwardShare.objective` is what backward takes: the model's loss share plus the coefficient times the aux
share, scaled so that FSDP's average of the gradients over ranks is the gradient of the global per-token mean
(:meth:`ForwardShare.with_aux`: the same for a trainer that scales the model's loss itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from twinkle_strategy.moe.balance import GlobalBatchAuxLoss, RouterStats

# A front-end's forward of a micro-batch (as the model takes it): (its loss share, what it returns beside).
Forward = Callable[[dict], tuple[torch.Tensor, Any]]
# The strategy's replay_of_batch, or a front-end's: (the batch without its routing record, the context replaying it).
ReplayOf = Callable[[dict], tuple[dict, contextlib.AbstractContextManager]]


@dataclasses.dataclass(frozen=True)
class ForwardShare:
    """One training forward's part of the step."""

    loss: torch.Tensor  # the model's loss share (its token-loss sum / the step's global token count), as returned
    aux: torch.Tensor | None  # its share of the global aux loss, without the coefficient; None: no such loss
    coef: float  # the aux loss's coefficient (0 without one)
    outputs: Any  # what the front-end's forward returned beside the loss
    router: RouterStats | None  # the step's global router statistics the share was taken against

    @property
    def aux_or_zero(self) -> torch.Tensor:
        return self.aux if self.aux is not None else torch.zeros((), device=self.loss.device)

    def objective(self, *, loss_scale: int) -> torch.Tensor:
        """What backward takes, for a front-end that runs backward itself (twinkle's): the loss share plus the
        coefficient times the aux share, times ``loss_scale`` (the step core's: FSDP averages gradients over every
        rank, and the shares add up over ranks to the global mean)."""
        return (self.loss + self.coef * self.aux_or_zero) * loss_scale

    def with_aux(self, *, aux_scale: int) -> torch.Tensor:
        """The loss to hand to a trainer that scales the model's loss itself (``transformers.Trainer``: by the
        processes, and for accumulation): the model's loss as it gave it, plus the coefficient times the aux share
        scaled by ``aux_scale`` alone (:func:`~twinkle_strategy.integrations.transformers.aux_loss.share_scale`)."""
        if self.aux is None:
            return self.loss
        return self.loss + self.coef * self.aux * aux_scale


@contextlib.contextmanager
def first_forward_routing(model: nn.Module, aux_loss: GlobalBatchAuxLoss) -> Iterator[types.SimpleNamespace]:
    """While open: the first forward's ``router_logits`` (its backbone's output) and the model's own ``aux_loss``
    (the output of ``model``, what the trainer calls), as the namespace yielded; None where absent."""
    found = types.SimpleNamespace(router_logits=None, aux_loss=None)
    seen = {"backbone": False, "model": False}

    def on_backbone(_module, _args, output):
        if not seen["backbone"]:
            seen["backbone"] = True
            found.router_logits = getattr(output, "router_logits", None)

    def on_model(_module, _args, output):
        if not seen["model"]:
            seen["model"] = True
            found.aux_loss = getattr(output, "aux_loss", None)

    backbone = aux_loss.balancing.owner.base_model
    handles = [backbone.register_forward_hook(on_backbone), model.register_forward_hook(on_model)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def forward_share(model: nn.Module, batch: dict, *, forward: Forward, replay_of: ReplayOf,
                  balancing: GlobalBatchAuxLoss | None, router: RouterStats | None) -> ForwardShare:
    """``forward`` of ``batch`` with its routing record replayed and, in training with ``balancing``, the forward's
    share of the step's global aux loss. ``router``: the step's global router statistics (the step core's router
    pre-pass), or None: this forward's own, summed over ranks (a collective: one forward per step)."""
    balancing = balancing if model.training else None
    batch, replay = replay_of(batch)
    with replay as replayed:
        if balancing is None:
            loss, outputs = forward(batch)
            return ForwardShare(loss=loss, aux=None, coef=0.0, outputs=outputs, router=router)
        with first_forward_routing(model, balancing) as routing:
            loss, outputs = forward({**batch, "output_router_logits": True})
    aux, router = balancing.share(routing, batch.get("attention_mask"), router, getattr(replayed, "used", None))
    return ForwardShare(loss=loss, aux=aux, coef=balancing.coef, outputs=outputs, router=router)
