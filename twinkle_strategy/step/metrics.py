"""What a log line reports of the steps since the last one, the same in every front-end: the tokens trained, the
throughput (``tokens_per_second``, ``flops_per_token``, ``tflops_per_device``, ``mfu`` where the device's peak is
known) and the expert load (``moe_load_imbalance``).

Everything is counted on whole rows, as collated, before the sequence split, so that the numbers do not depend on how
a front-end cuts, groups or spreads the rows:

* the tokens are the real ones (no padding) of every rank's rows; the ranks of a sequence-parallel group hold the
  same rows, each counts its share of them;
* the FLOPs model's sequence length is the attention length: the length a token attends over, which is its
  example's (a padded row: its real tokens; a packed row: each example it packs, as its positions restart). Over
  the window it is weighted by tokens (sum over examples of length squared / tokens), the mean FLOPs per token;
* the expert load is the router's choices over the global batch (:mod:`twinkle_strategy.moe.load`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from twinkle_strategy.moe.load import load_imbalance
from twinkle_strategy.step.collectives import all_reduce_sum


def length_sums(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[tokens, sum over examples of length x length]`` of a collated batch (whole rows), float64 on the batch's
    device, computed without a host sync (the counts stay on the device until a log line takes them).

    A packed row's example of ``n`` tokens has positions ``0 .. n-1``, and ``sum(2p + 1)`` over them is ``n * n``:
    no search for where examples start (``nonzero``, which waits for the device) is needed."""
    mask = batch.get("attention_mask")
    if mask is not None:
        lengths = torch.as_tensor(mask).sum(dim=-1).double()
        return torch.stack([lengths.sum(), (lengths * lengths).sum()])
    ids = torch.as_tensor(batch["input_ids"])
    positions = batch.get("position_ids")
    if positions is None:
        rows, length = (ids.shape[0] if ids.dim() > 1 else 1), ids.shape[-1]
        return torch.tensor([rows * length, rows * length * length], dtype=torch.float64, device=ids.device)
    positions = torch.as_tensor(positions).double()
    return torch.stack([positions.new_tensor(float(positions.numel())), (2 * positions + 1).sum()])


def attention_length(batch: Mapping[str, torch.Tensor]) -> float:
    """The sequence length a token of ``batch`` attends over on average, for the attention FLOPs: each example's
    length weighted by its tokens (sum of squares / tokens)."""
    tokens, squares = length_sums(batch).tolist()
    return squares / max(tokens, 1.0)


class StepMetrics:
    """The throughput and expert-load fields of the steps since the last log line.

    ``observe`` each training micro-batch as collated (whole rows); ``take`` at each log line, on every rank
    (collective)."""

    def __init__(self, step_core) -> None:
        self.step_core = step_core
        # Under sequence parallelism the ranks of a group observe the same rows: each counts its share of them.
        self.share = 1.0 / step_core.sequence_parallel
        self.restart()

    def restart(self) -> None:
        """Start a new window now (its clock included)."""
        self.sums: list[torch.Tensor] = []  # per micro-batch [tokens, sum of length x length], on its device
        self.expert_counts: torch.Tensor | None = None
        self.since = time.perf_counter()

    def observe(self, batch: Mapping[str, torch.Tensor]) -> None:
        """A training micro-batch as collated (whole rows, before the split): count its tokens and their attention
        length."""
        self.sums.append(length_sums(batch) * self.share)

    def add_expert_counts(self, counts: torch.Tensor | None) -> None:
        """A step's global [layers, experts] counts, where the front-end took them already (twinkle's trainer takes
        them every step, for the aux-loss-free biases); otherwise :meth:`take` takes them. Summed on the device
        (integer counts in fp32: exact, in any order, below 2**24 per expert): the host reads them at :meth:`take`."""
        if counts is not None:
            counts = counts.detach().float()
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts

    def take(self) -> tuple[dict[str, float], torch.Tensor | None]:
        """(the log fields since the last call, the window's global [layers, experts] expert counts or None: not
        MoE), over every rank (collective); starts a new window."""
        seconds = time.perf_counter() - self.since
        core = self.step_core
        totals = sum((sums.to(core.device) for sums in self.sums),
                     torch.zeros(2, dtype=torch.float64, device=core.device))
        totals = all_reduce_sum(totals)
        tokens, attended = totals.tolist()
        seq_len = attended / max(tokens, 1.0)
        fields: dict[str, float] = {"tokens": round(tokens, 3), **core.throughput(tokens=tokens, seq_len=seq_len,
                                                                                  seconds=seconds)}
        fields["flops_per_token"] = round(core.flops.per_token(seq_len), 3)
        counts = self.expert_counts
        if counts is None:
            counts = core.take_expert_counts()
        counts = counts.detach().float().cpu() if counts is not None else None
        if counts is not None and counts.sum() > 0:
            fields["moe_load_imbalance"] = round(load_imbalance(counts), 6)
        self.restart()
        return fields, counts
