"""NativeFSDPStrategy inside ``transformers.Trainer`` and its subclasses (TRL's ``SFTTrainer``, ms-swift's).

trainer.py       the mixin and :func:`with_strategy`: loading, wrapping, clipping, saving and resuming
aux_loss.py      the model's (or TRL's) load-balancing loss counted over the global batch
step_metrics.py  tokens_per_second, moe_load_imbalance and mfu in HF's log lines
sequence.py      packed rows; under sequence parallelism the data path (a group shares its examples) and refusals
refusals.py      settings that would shard the model a second time, refused in one line
async_save.py    async_save=True: checkpoints staged at the save step, written in the background, renamed when complete
"""

from twinkle_strategy.integrations.transformers.refusals import (  # noqa: F401
    refuse_conflicting_sharding,
    refuse_transformers_expert_parallel,
)
from twinkle_strategy.integrations.transformers.trainer import (  # noqa: F401
    StrategyTrainerMixin,
    prepare_for_trainer,
    with_strategy,
)
