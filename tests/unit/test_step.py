"""The step core's one-process parts: its policy object and what it reads off a batch (twinkle_strategy.step)."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle_strategy.step import StepPolicy, all_reduce_sum, attention_length
from twinkle_strategy.step.core import left_padded
from twinkle_strategy.step.metrics import length_sums


def test_the_policy_is_one_frozen_keyword_only_object():
    with pytest.raises(TypeError):
        StepPolicy(1.0)  # positional: refused, so a new field can never shift an old call's meaning
    policy = StepPolicy(max_grad_norm=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_grad_norm = 2.0


def test_left_padding_is_told_from_right_padding():
    # The sequence split keeps attention causal without a padding mask: only right padding is safe.
    assert left_padded({"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})
    assert not left_padded({"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    assert not left_padded({"input_ids": torch.ones(1, 4)})  # a packed row has no mask


def test_without_a_process_group_sums_are_local_and_packed_rows_attend_per_example():
    assert all_reduce_sum(torch.tensor([3, 4])).tolist() == [3, 4]
    packed = {"input_ids": torch.ones(1, 7), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]])}
    assert attention_length(packed) == pytest.approx((16 + 9) / 7)  # each token attends over its own example


def test_a_token_attends_over_its_own_example_whether_padded_or_packed():
    # The FLOPs model's length, one formula for every front-end (twinkle_strategy.step.metrics): the same examples
    # (3 and 2 real tokens) padded into rows, or flattened into one row, attend over the same length.
    padded = {"input_ids": torch.ones(2, 4), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    packed = {"input_ids": torch.ones(1, 5), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert length_sums(padded).tolist() == length_sums(packed).tolist() == [5, 9 + 4]  # tokens, sum of squares
    assert attention_length(padded) == attention_length(packed) == pytest.approx((9 + 4) / 5)
    assert length_sums({"input_ids": torch.ones(2, 4)}).tolist() == [8, 32]  # no mask, no positions: whole rows


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``.item()``, ``float(t)``, ``.tolist()``, ``nonzero``)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.syncs.append(func)
        return func(*args, **(kwargs or {}))


def test_counting_a_micro_batch_for_the_metrics_waits_for_no_device():
    # StepMetrics.observe counts every micro-batch with length_sums, inside the step: on a GPU a host sync there
    # stalls the queue. The counts stay tensors until the log line's take().
    padded = {"input_ids": torch.ones(2, 4), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    packed = {"input_ids": torch.ones(1, 5), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    with _HostSyncs() as counted:
        sums = length_sums(padded) + length_sums(packed) + length_sums({"input_ids": torch.ones(2, 4)})
    assert counted.syncs == []
    assert sums.tolist() == [18, 58]
