"""What one logging window of training steps adds to logging.jsonl beyond the loss.

Every field is global: the trainer hands over step results that are already
summed over ranks (tokens, losses, expert counts), so rank 0 can log them.
"""

from __future__ import annotations

import time

import torch

from twinkle_strategy.moe.load import load_imbalance
from twinkle_strategy.step import TrainingStep


class StepWindow:
    """Step results since the last log line: mean loss, last grad norm, expert load, throughput."""

    def __init__(self, step_core: TrainingStep, *, with_aux: bool) -> None:
        self.step_core, self.with_aux = step_core, with_aux
        self._reset()

    def _reset(self) -> None:
        self.steps: list[dict] = []
        self.started = time.perf_counter()
        self.expert_counts: torch.Tensor | None = None

    def add(self, result: dict) -> None:
        self.steps.append(result)
        counts = result.get("expert_counts")
        if counts is not None:
            counts = counts.detach().float().cpu()
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts

    def __len__(self) -> int:
        return len(self.steps)

    def take(self) -> tuple[dict, torch.Tensor | None]:
        """(log fields of the window, its [layers, experts] global expert counts); starts a new window."""
        seconds = time.perf_counter() - self.started
        steps, counts = self.steps, self.expert_counts
        fields = {"loss": sum(s["loss"] for s in steps) / len(steps), "grad_norm": steps[-1]["grad_norm"]}
        extra = {}
        if self.with_aux:
            extra["aux_loss"] = round(sum(s["aux_loss"] for s in steps) / len(steps), 6)
        if counts is not None:
            extra["moe_load_imbalance"] = round(load_imbalance(counts), 6)
        agreement = steps[-1].get("routing_agreement")
        if agreement is not None:  # routing replay: per MoE layer, the share of replayed tokens whose recorded
            # experts are the ones the router would have chosen itself
            extra["routing_agreement"] = [round(a, 4) for a in agreement]
        tokens = sum(s["tokens"] for s in steps)
        seq_len = sum(s["seq_len"] for s in steps) / len(steps)
        extra.update(self.step_core.throughput(tokens=tokens, seq_len=seq_len, seconds=seconds))
        self._reset()
        return {**fields, "extra": extra}, counts
