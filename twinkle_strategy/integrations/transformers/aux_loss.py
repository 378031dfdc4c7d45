"""The MoE load-balancing loss counted over the global batch inside ``transformers.Trainer`` and TRL's ``SFTTrainer``.

Under data parallelism transformers' Trainer (the model's own ``aux_loss``) and TRL's trainers
(``router_aux_loss_coef * outputs.aux_loss``, on by default with the model's coefficient since TRL
1.x) balance each rank's micro-batch on its own. Here the same term is counted over the global batch
(:class:`twinkle_strategy.moe.balance.GlobalBatchAuxLoss`): the one each takes over is silenced, and
each (rank, micro-batch) adds its share, scaled so that the step's gradient is that of the loss one
process computes on the concatenated batch.

The forward and its share are the step's (:mod:`twinkle_strategy.step.forward`: TRL's fused forwards return no
router logits, so they are read off the model's backbone), as is the router pre-pass
(:meth:`~twinkle_strategy.step.TrainingStep.router_prepass`); what is the trainer's: which loss it adds, and how it
scales what ``compute_loss`` returns (:func:`share_scale`).

GRPO's log lines report that global loss as ``aux_loss`` (:class:`GlobalAuxLossWindow`, :mod:`.grpo`) where TRL would log
the mean over ranks of each rank's own term, which is not what the step trained on (``SFTTrainer``'s line still
carries TRL's).
"""

from __future__ import annotations

import fractions

import torch
from torch import nn

from twinkle_strategy.moe.balance import GlobalBatchAuxLoss
from twinkle_strategy.step import all_reduce_sum


def take_over_aux_loss(trainer, model: nn.Module) -> GlobalBatchAuxLoss | None:
    """The global-batch loss replacing the per-rank, per-micro-batch one ``trainer`` would add, or None if it
    adds none."""
    if hasattr(trainer, "aux_loss_enabled") and hasattr(trainer, "router_aux_loss_coef"):
        # TRL's trainers: their coefficient (SFTConfig.router_aux_loss_coef; None takes the model's), and they add
        # `coef * outputs.aux_loss` themselves. From here on they add zero; the
        # aux_loss they log is their own (each rank's term): GlobalAuxLossWindow's replaces it where a mixin says so.
        if not trainer.aux_loss_enabled:
            return None
        coef = float(trainer.router_aux_loss_coef)
        trainer.router_aux_loss_coef = 0.0
        return GlobalBatchAuxLoss.replacing_model_term(model, coef=coef)
    owner = next((m for m in model.modules() if hasattr(m, "router_aux_loss_coef")), None)
    if owner is None or not getattr(owner.config, "output_router_logits", False) or not owner.router_aux_loss_coef > 0:
        return None
    return GlobalBatchAuxLoss.replacing_model_term(model, coef=float(owner.router_aux_loss_coef))


def share_scale(trainer, num_items_in_batch) -> int:
    """What a (rank, micro-batch) share of the global loss is multiplied by: the shares add up over ranks and
    micro-batches to the global loss, FSDP averages gradients over the ranks, and ``training_step`` divides the
    loss by the accumulation steps unless it is already scaled for them (transformers' own rule)."""
    scale = trainer.step_core.loss_scale
    scaled_for_accumulation = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled_for_accumulation is None:
        scaled_for_accumulation = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or trainer.compute_loss_func is not None
    if not scaled_for_accumulation:
        scale *= trainer.current_gradient_accumulation_steps
    return scale


class GlobalAuxLossWindow:
    """The global-batch aux loss the optimizer steps since the last log line trained on (its mean over those steps).

    Each training forward adds its (rank, micro-batch) share: summed over ranks and the step's micro-batches, the
    shares are the loss one process computes on the step's whole batch, so it is the same number on every rank."""

    def __init__(self, device: torch.device) -> None:
        self.shares = torch.zeros((), dtype=torch.float64, device=device)  # this rank's, on the device: no sync
        self.steps = fractions.Fraction(0)  # each forward is 1/(its step's micro-batches) of a step, exactly

    def add(self, share: torch.Tensor, *, accumulation_steps: int) -> None:
        """A training forward's share of its step's aux loss (without the coefficient); ``accumulation_steps``: the
        micro-batches of that step."""
        self.shares += share.detach().double()
        self.steps += fractions.Fraction(1, accumulation_steps)

    def take(self) -> float | None:
        """The mean over the steps since the last call of their global aux loss, or None if none trained (every
        rank saw the same forwards: collective on all or on none); resets."""
        if not self.steps:
            return None
        value = float(all_reduce_sum(self.shares)) / float(self.steps)
        self.shares, self.steps = torch.zeros_like(self.shares), fractions.Fraction(0)
        return value
