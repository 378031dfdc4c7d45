"""What HF's log lines gain under the strategy: ``tokens_per_second``, ``moe_load_imbalance`` and ``mfu``.

Tokens are the non-padding tokens of every rank (the attention mask), counted between two log
lines; the expert load is the router's real choices over the global batch (:mod:`twinkle_strategy.moe.load`);
MFU is the usual ``6 x active parameters`` estimate against the device's known peak, absent where the
peak is unknown (CPU).
"""

from __future__ import annotations

import time

import torch

from twinkle_strategy.moe.load import load_imbalance
from twinkle_strategy.step import TrainingStep, all_reduce_sum


class StepMetrics:
    """Counts tokens and expert load between two HF log lines (``observe`` each training micro-batch, whole rows)."""

    def __init__(self, step_core: TrainingStep) -> None:
        self.step_core = step_core
        self.device = step_core.strategy.device
        # Under sequence parallelism the ranks of a group observe the same rows: each counts its share of them.
        self.share = 1.0 / step_core.sequence_parallel
        self.tokens = 0.0
        self.sequences = 0.0
        self.since = time.perf_counter()

    def observe(self, inputs: dict) -> None:
        """A training micro-batch as collated (whole rows): count its tokens and sequences."""
        mask = inputs.get("attention_mask")
        ids = inputs.get("input_ids")
        if mask is not None:
            self.tokens += int(mask.sum()) * self.share
            self.sequences += mask.shape[0] * self.share
        elif ids is not None:
            self.tokens += ids.numel() * self.share
            positions = inputs.get("position_ids")
            # A packed row holds one sequence per restart of its positions (the attention FLOPs' length).
            self.sequences += (int((positions == 0).sum()) if positions is not None else ids.shape[0]) * self.share

    def take(self) -> dict[str, float]:
        """The fields since the last call, over every rank (collective); resets."""
        totals = all_reduce_sum(torch.tensor([self.tokens, self.sequences], dtype=torch.float64, device=self.device))
        tokens, sequences = totals.tolist()
        seconds = time.perf_counter() - self.since
        fields: dict[str, float] = {}
        core = self.step_core
        if core.expert_load is not None and sequences:
            fields.update(core.throughput(tokens=tokens, seq_len=tokens / sequences, seconds=seconds))
        else:
            fields["tokens_per_second"] = round(tokens / max(seconds, 1e-9), 3)
        counts = core.take_expert_counts()
        if counts is not None and counts.sum() > 0:
            fields["moe_load_imbalance"] = round(load_imbalance(counts), 6)
        self.tokens = self.sequences = 0.0
        self.since = time.perf_counter()
        return fields
