"""GRPO through TRL, one process: the trainer class with_strategy builds, the rollout record's alignment with
TRL's padded batch, the check of TRL's steps (tests/multiproc/test_grpo.py trains at 2 nodes x 2)."""

from __future__ import annotations

import types

import pytest
import torch

from twinkle_strategy.compat import trl_internals
from twinkle_strategy.errors import InternalChangedError
from twinkle_strategy.integrations.transformers import StrategyTrainerMixin, with_strategy
from twinkle_strategy.integrations.transformers.grpo import StrategyGRPOTrainerMixin


def test_with_strategy_gives_grpo_trainers_the_grpo_mixin():
    from trl import GRPOTrainer, SFTTrainer

    grpo = with_strategy(GRPOTrainer)
    assert grpo.__name__ == "StrategyGRPOTrainer" and issubclass(grpo, StrategyGRPOTrainerMixin)
    assert grpo.__mro__[1:3] == (StrategyGRPOTrainerMixin, StrategyTrainerMixin)
    subclass = type("MyGRPOTrainer", (GRPOTrainer,), {})  # a user's subclass too
    assert issubclass(with_strategy(subclass), StrategyGRPOTrainerMixin)
    sft = with_strategy(SFTTrainer)
    assert sft.__name__ == "StrategySFTTrainer" and not issubclass(sft, StrategyGRPOTrainerMixin)


def test_the_rollout_record_aligns_with_trls_padded_prompts_and_completions():
    """Prompts padded on the left and completions on the right, each to pad_to_multiple_of, -1 on the padding: the
    layout of TRL's cat([prompt_ids, completion_ids])."""
    def part(tokens: int, first: int) -> torch.Tensor:  # [tokens, layers=2, top_k=1], ids first, first + 1, ...
        return torch.arange(first, first + tokens).view(tokens, 1, 1).expand(tokens, 2, 1)

    prompts, completions = [part(3, 0), part(1, 3)], [part(2, 4), part(4, 0)]
    trainer = types.SimpleNamespace(pad_to_multiple_of=None)
    record = StrategyGRPOTrainerMixin._padded_record(trainer, prompts, completions)
    assert record.shape == (2, 3 + 4, 2, 1)
    assert record[0, :, 0, 0].tolist() == [0, 1, 2, 4, 5, -1, -1]
    assert record[1, :, 0, 0].tolist() == [-1, -1, 3, 0, 1, 2, 3]
    trainer.pad_to_multiple_of = 4
    record = StrategyGRPOTrainerMixin._padded_record(trainer, prompts, completions)
    assert record.shape == (2, 4 + 4, 2, 1)
    assert record[1, :, 1, 0].tolist() == [-1, -1, -1, 3, 0, 1, 2, 3]


def test_a_grpo_step_trl_renamed_is_named_when_the_class_is_built(monkeypatch):
    from trl import GRPOTrainer

    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(InternalChangedError, match="GRPOTrainer._generate_single_turn is gone, so its override "
                                                   "would never run"):
        trl_internals.check_grpo_overrides(StrategyGRPOTrainerMixin)
