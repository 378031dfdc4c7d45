"""Trainer/rollout mismatch telemetry (twinkle_strategy/rl/mismatch.py), one process: the logprob gap, the k3 KL and
the routing disagreement against figures computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_strategy.rl.mismatch import LogprobMismatch, logprob_mismatch, routing_disagreement


def test_logprob_mismatch_is_the_mean_gap_and_the_k3_kl_over_completion_tokens():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    rollout = torch.tensor([[-1.5, -2.0, -2.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # the padding's huge gaps are not counted
    mismatch = logprob_mismatch(trainer, rollout, mask=mask)
    log_ratios = [0.5, 0.0, -1.0, -0.25]
    assert mismatch.tokens == 4
    assert mismatch.mean_abs == pytest.approx(sum(abs(r) for r in log_ratios) / 4)
    assert mismatch.kl_k3 == pytest.approx(sum(math.exp(r) - 1 - r for r in log_ratios) / 4)


def test_the_k3_kl_is_zero_for_the_same_policy_and_positive_otherwise():
    logps = torch.log_softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), dim=-1)
    same = logprob_mismatch(logps, logps.clone())
    assert same.mean_abs == 0.0 and same.kl_k3 == 0.0
    assert logprob_mismatch(logps, logps + 0.1).kl_k3 > 0


def test_logprob_mismatch_with_nothing_to_compare_or_shapes_that_differ():
    assert logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.zeros(2, 3)) is None
    with pytest.raises(ValueError, match=r"trainer logprobs \[2, 3\] and rollout logprobs \[2, 4\]"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4))


def test_routing_disagreement_counts_token_layer_decisions_whose_sets_differ():
    # [tokens=3, layers=2, top_k=2]
    reference = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    routed = torch.tensor([[[1, 0], [2, 3]],   # the same sets in another order: agree
                           [[4, 6], [6, 7]],   # layer 0 differs
                           [[-1, -1], [0, 3]]])  # layer 0 not recorded (not compared), layer 1 differs
    assert routing_disagreement(reference, routed) == pytest.approx(2 / 5)
    assert routing_disagreement(reference, routed, mask=torch.tensor([1, 0, 0])) == 0.0
    assert routing_disagreement(reference, torch.full_like(reference, -1)) is None


class _LossForward:
    """In place of TRL's GRPOTrainer under the mixin: its compute_loss runs the policy's logprob forward through
    ``_get_per_token_logps_and_entropies`` (as TRL's ``_compute_loss`` does), which answers ``trainer_logps``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, _, _ = self._get_per_token_logps_and_entropies(model, inputs["completion_ids"], None, 3)
        return -logps.mean()

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        return self.trainer_logps, None, None


@pytest.mark.parametrize("key", ["sampling_per_token_logps", "rollout_logprobs"])
def test_the_grpo_mixin_logs_the_rollout_logprob_mismatch_of_each_loss_forward(key):
    import contextlib
    import types

    from twinkle_strategy.integrations.transformers.grpo import StrategyGRPOTrainerMixin, rollout_mismatch_logs

    trainer = object.__new__(type("Trainer", (StrategyGRPOTrainerMixin, _LossForward), {}))
    trainer.model = types.SimpleNamespace(training=True)
    trainer.strategy = types.SimpleNamespace(replay_of_batch=lambda batch: (batch, contextlib.nullcontext()))
    trainer.global_aux_loss, trainer._batch_record, trainer._record_old_policy = None, None, False
    trainer._training_logps, trainer._rollout_mismatches = None, []
    trainer.trainer_logps = torch.tensor([[-1.0, -2.0, -3.0]])
    inputs = {"completion_ids": torch.zeros(1, 3, dtype=torch.long), "completion_mask": torch.tensor([[1, 1, 0]]),
              key: torch.tensor([[-1.5, -2.0, 0.0]])}
    trainer.compute_loss(trainer.model, inputs)
    trainer.compute_loss(trainer.model, {k: v for k, v in inputs.items() if k != key})  # no rollout logprobs
    (mismatch,) = trainer._rollout_mismatches
    assert trainer._training_logps is None and mismatch.tokens == 2
    assert mismatch.mean_abs == pytest.approx(0.25) and mismatch.kl_k3 == pytest.approx((math.exp(0.5) - 1.5) / 2)
    # A log line's figures: the steps since the last line, weighted by their tokens.
    other = LogprobMismatch(mean_abs=1.0, kl_k3=0.5, tokens=6)
    assert rollout_mismatch_logs([mismatch, other]) == {
        "rollout/logprob_abs_diff": pytest.approx((0.25 * 2 + 6) / 8),
        "rollout/kl_k3": pytest.approx((mismatch.kl_k3 * 2 + 3) / 8)}
