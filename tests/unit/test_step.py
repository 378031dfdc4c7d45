"""The step core's one-process parts: its policy object and what it reads off a batch (twinkle_strategy.step)."""

import dataclasses

import pytest
import torch

from twinkle_strategy.step import StepPolicy, all_reduce_sum, attention_length
from twinkle_strategy.step.core import left_padded
from twinkle_strategy.step.metrics import example_lengths


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
    assert example_lengths(padded).tolist() == example_lengths(packed).tolist() == [3, 2]
    assert attention_length(padded) == attention_length(packed) == pytest.approx((9 + 4) / 5)
    assert example_lengths({"input_ids": torch.ones(2, 4)}).tolist() == [4, 4]  # no mask, no positions: whole rows
