"""NativeFSDPStrategy inside ``transformers.Trainer`` and its subclasses (TRL's ``SFTTrainer``, ms-swift's).

trainer.py       the mixin: loading, wrapping, saving; the step (twinkle_strategy.step) at HF's seams
classes.py       :func:`with_strategy`: the trainer class with the strategy's mixin first (GRPO's for GRPOTrainer)
aux_loss.py      the model's (or TRL's) load-balancing loss counted over the global batch
sequence.py      packed rows; under sequence parallelism the data path (a group shares its examples) and refusals
cpu.py           a CPU strategy: transformers and TRL count every rank without use_cpu=True
refusals.py      settings that would shard the model a second time, refused in one line
async_save.py    async_save=True: checkpoints copied into host memory at the save step, written in the
                 background, renamed when complete
run_log.py       output_dir/logging.jsonl, and where the results are, printed when training ends
grpo.py          TRL's GRPOTrainer: generation on every rank, routing replay (R3/R2) of its rollouts
"""

from twinkle_strategy.integrations.transformers.classes import with_strategy  # noqa: F401
from twinkle_strategy.integrations.transformers.refusals import (  # noqa: F401
    refuse_conflicting_sharding,
    refuse_transformers_expert_parallel,
)
from twinkle_strategy.integrations.transformers.trainer import (  # noqa: F401
    StrategyTrainerMixin,
    prepare_for_trainer,
)
