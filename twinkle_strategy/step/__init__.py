"""One training step for every front-end (twinkle's ``Trainer``, the ``transformers.Trainer`` mixin and so TRL's
trainers and the ms-swift plugin): the sequence split, the global token count, the router pre-pass, the loss scale,
clipping, the expert-load and throughput metrics.

* :mod:`.core`: :class:`TrainingStep`, configured by the frozen :class:`StepPolicy`.
"""

from twinkle_strategy.step.core import (
    StepBatches,
    StepPolicy,
    TokenCounts,
    TrainingStep,
    all_reduce_sum,
    attention_length,
    expert_load_or_none,
    real_token_count,
)

__all__ = ["StepBatches", "StepPolicy", "TokenCounts", "TrainingStep", "all_reduce_sum", "attention_length",
           "expert_load_or_none", "real_token_count"]
