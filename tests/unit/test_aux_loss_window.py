"""The aux loss a GRPO log line reports under the strategy (integrations/transformers/aux_loss.py): the mean over the
line's steps of each step's global-batch loss, the sum of its forwards' shares (tests/multiproc/test_grpo.py compares
it with one process)."""

from __future__ import annotations

import pytest
import torch

from twinkle_strategy.integrations.transformers.aux_loss import GlobalAuxLossWindow


def test_a_log_line_reports_the_mean_of_its_steps_summed_shares():
    window = GlobalAuxLossWindow(torch.device("cpu"))
    assert window.take() is None  # no training forward since the last line: nothing to report (and no collective)
    window.add(torch.tensor(1.0, requires_grad=True), accumulation_steps=2)  # step 1: two micro-batches
    window.add(torch.tensor(1.5), accumulation_steps=2)
    window.add(torch.tensor(2.0), accumulation_steps=1)  # step 2 (the last of an epoch): one
    assert window.take() == pytest.approx((1.0 + 1.5 + 2.0) / 2)
    assert window.take() is None  # taken: the next line starts afresh
    window.add(torch.tensor(0.25), accumulation_steps=1)
    assert window.take() == 0.25
