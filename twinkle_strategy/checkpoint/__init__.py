"""Checkpoints in both directions.

training.py         what a training run writes and resumes from (``checkpoint-{step}/``), on any layout
manager.py          a run's checkpoints: paths, the save interval, rotation, the newest complete one to resume from
files.py            safetensors files read by header and byte range, never whole
writer.py           safetensors files planned on every rank and written in parallel, each rank its own bytes
layout.py           how a model's tensors are made from a hub checkpoint's tensors (transformers' conversion
                    rules), and back
sharded_io.py       each rank's rows of each tensor: written into the files, read back (tensors a rule needs
                    whole go through their owner rank: :mod:`twinkle_strategy.shards.whole_tensors`)
model_files.py      the model as a Hugging Face checkpoint, written in parallel
optimizer_files.py  optimizer state and adapter weights by full tensor, for resuming on another layout
durable.py          directories that exist under their final name only when complete (staged, fsynced, renamed)
staging.py          asynchronous saves: what a save writes, copied into host buffers reused from save to save
background.py       asynchronous saves: a thread writes the staged bytes; failures and the commit at step boundaries
async_saves.py      asynchronous saves of a run: one in flight, the next waits for it, buffers and plans reused
merged_export.py    a LoRA run's adapters merged into the base, unit by unit, written as bf16 or in the release's format
shared_directory.py the check that every rank sees the output directory (one filesystem on every node)
"""

from twinkle_strategy.checkpoint.manager import (  # noqa: F401
    CheckpointManager,
    latest_checkpoint,
    rotate_checkpoints,
)
from twinkle_strategy.checkpoint.training import (  # noqa: F401
    STATE_FILE,
    CheckpointSaveError,
    ResumeError,
    SaveReport,
    is_peft_model,
    load_checkpoint,
    save_checkpoint,
    trainable_names,
)
