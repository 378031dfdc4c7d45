"""What one logging window of training steps adds to logging.jsonl beyond the loss.

Every field is global: the trainer hands over step results that are already summed over ranks (losses, expert
counts), so rank 0 can log them. The tokens, throughput and expert load are the step's own fields, the same in
every front-end (:class:`twinkle_strategy.step.StepMetrics`).

The step results are device tensors: the window keeps them there and reads them on the host once, in
:meth:`StepWindow.take` (the log line), so a step between two log lines never waits for the device.
"""

from __future__ import annotations

import torch

from twinkle_strategy.rl.replay import agreement_shares
from twinkle_strategy.step import StepMetrics


class StepWindow:
    """Step results since the last log line: mean loss, last grad norm, mean aux loss, routing agreement; and the
    step's metrics (tokens, throughput, expert load)."""

    def __init__(self, metrics: StepMetrics, *, with_aux: bool) -> None:
        self.metrics, self.with_aux = metrics, with_aux
        self.steps: list[dict] = []
        metrics.restart()  # the first window's clock starts with training, not with the set-up

    def add(self, result: dict) -> None:
        self.steps.append(result)
        self.metrics.add_expert_counts(result.get("expert_counts"))

    def __len__(self) -> int:
        return len(self.steps)

    def take(self) -> tuple[dict, torch.Tensor | None]:
        """(log fields of the window, its [layers, experts] global expert counts); starts a new window. Collective
        (every rank logs)."""
        steps = self.steps
        # The window's host reads: each step's (loss, aux loss) in one copy, the last grad norm. Averaged in Python
        # as floats, in step order: the numbers a per-step read gave.
        losses, auxes = zip(*torch.stack([torch.stack([s["loss"], s["aux_loss"]]) for s in steps]).tolist(),
                            strict=True)
        fields = {"loss": sum(losses) / len(steps), "grad_norm": float(steps[-1]["grad_norm"])}
        extra = {}
        if self.with_aux:
            extra["aux_loss"] = round(sum(auxes) / len(steps), 6)
        step_fields, counts = self.metrics.take()
        if "moe_load_imbalance" in step_fields:
            extra["moe_load_imbalance"] = step_fields.pop("moe_load_imbalance")
        agreeing = steps[-1].get("routing_agreement")  # the last step's [layers, (agreeing, replayed)] counts
        agreement = agreement_shares(agreeing) if agreeing is not None else None
        if agreement is not None:  # routing replay: per MoE layer, the share of replayed tokens whose recorded
            # experts are the ones the router would have chosen itself
            extra["routing_agreement"] = [round(a, 4) for a in agreement]
        extra.update(step_fields)
        self.steps = []
        return {**fields, "extra": extra}, counts
