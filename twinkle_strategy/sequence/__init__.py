"""Ulysses sequence parallelism: each rank of a sequence-parallel group holds a contiguous chunk of every sequence;
and packed rows (several examples per row), which it composes with.

* :mod:`.support`: which models and sizes it can serve, checked from the config before weights load.
* :mod:`.exchange`: the all-to-alls that turn [sequence chunk, all heads] into [whole sequence, heads / sp].
* :mod:`.attention`: the attention function registered with transformers' ``AttentionInterface``
  that wraps the model's own one (sdpa, flash, flex) with those exchanges.
* :mod:`.batch`: cutting a batch into the rank's chunk, with global position ids and shifted labels; the tokens a
  batch's loss is taken over.
* :mod:`.packed`: whether a model keeps packed examples apart (``check_packable``), and preparing it for them.
"""

from twinkle_strategy.sequence.attention import apply_sequence_parallel
from twinkle_strategy.sequence.batch import loss_tokens, split_batch
from twinkle_strategy.sequence.support import check_sequence_parallel, refuse_generation

__all__ = ["apply_sequence_parallel", "check_sequence_parallel", "loss_tokens", "refuse_generation", "split_batch"]
