"""One training step for every front-end (twinkle's ``Trainer``, the ``transformers.Trainer`` mixin and so TRL's
trainers and the ms-swift plugin), end to end.

* :mod:`.core`: :class:`TrainingStep`, configured by the frozen :class:`StepPolicy`: the sequence split, the global
  token count, the router pre-pass, the loss scale, a whole step's forwards and backwards for a front-end that runs
  its own backward (:meth:`TrainingStep.accumulate`), clipping;
* :mod:`.forward`: a training forward: replay, the global aux-loss share, what backward takes;
* :mod:`.metrics`: :class:`StepMetrics`, the log lines' tokens, throughput (one FLOPs formula) and expert load;
* :mod:`.collectives`: the sums over ranks (the strategy's ``global_loss_tokens``, ``reduce_sum``, ``reduce_mean``);
* :mod:`.resume`: what a resumed step restores.
"""

from twinkle_strategy.step.collectives import all_reduce_sum
from twinkle_strategy.step.core import (
    StepBatches,
    StepGradients,
    StepPolicy,
    TokenCounts,
    TrainingStep,
    expert_load_or_none,
    real_token_count,
)
from twinkle_strategy.step.forward import ForwardShare
from twinkle_strategy.step.metrics import StepMetrics, attention_length

__all__ = ["ForwardShare", "StepBatches", "StepGradients", "StepMetrics", "StepPolicy", "TokenCounts", "TrainingStep",
           "all_reduce_sum", "attention_length", "expert_load_or_none", "real_token_count"]
