"""Checkpoints in both directions.

training.py  what a training run writes and resumes from (``checkpoint-{step}/``)
files.py     safetensors files read by header and byte range, never whole
layout.py    how a model's tensors are made from a hub checkpoint's tensors (transformers' conversion rules)
"""

from twinkle_strategy.checkpoint.training import (  # noqa: F401
    STATE_FILE,
    CheckpointSaveError,
    ResumeError,
    _local,
    _optimizer_from_local,
    _optimizer_to_local,
    is_peft_model,
    latest_checkpoint,
    load_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
    trainable_names,
)
