"""Checkpoints in both directions.

save_plan.py        a save as data: its items (weights, adapter, config, tokenizer, front-end files), one frozen
                    context, and the one executor that carries every save out, synchronously or in the background
training.py         what each kind of save writes (a full model, a LoRA adapter, the trainer state, a merged
                    export), declared once as data; what a training run writes and resumes from
                    (``checkpoint-{step}/``), on any layout
manager.py          a run's checkpoints: paths, the save interval, rotation, the newest complete one to resume from
directories.py      the directories a save writes: seen by every rank, pending (``<name>.tmp``) until complete,
                    then fsynced and published under their final name
reading.py          reading safetensors checkpoints: by header and byte range, each rank only the rows it keeps
                    (the model through its hub layout, optimizer state and adapter weights by full tensor)
writing.py          writing safetensors checkpoints in parallel: files planned on every rank, each rank writing
                    only its own rows (the model in its hub layout, optimizer state and adapter weights by full
                    tensor, for resuming on another layout)
conversions.py      transformers' conversion rules of a model class, and which rows of a hub tensor make which rows
                    of a model tensor
layout.py           how a model's tensors are made from a hub checkpoint's tensors (the rules applied), and back
host_copies.py      asynchronous saves: what a save writes, copied into host buffers reused from save to save
background.py       asynchronous saves: a thread writes the host copies; one save in flight, failures and the
                    commit at step boundaries
merged_export.py    a LoRA run's adapters merged into the base, unit by unit, written as bf16 or in the release's
                    format (``save_merged``)
"""

from twinkle_strategy.checkpoint.manager import (  # noqa: F401
    CheckpointManager,
    CheckpointPolicy,
    latest_checkpoint,
    rotate_checkpoints,
)
from twinkle_strategy.checkpoint.save_plan import (  # noqa: F401
    SavePlan,
    SaveReport,
    execute_save,
    is_peft_model,
    trainable_names,
)
from twinkle_strategy.checkpoint.training import STATE_FILE, load_checkpoint, save_checkpoint  # noqa: F401
from twinkle_strategy.errors import CheckpointSaveError, ResumeError  # noqa: F401
