"""Resuming a step: what a step resumed from a checkpoint restores, declared once for every front-end.

A resumed step restores :data:`RESTORED`, whatever layout of nodes, ranks and ep_size saved the checkpoint (each rank
reads the rows of its own shards): the trained weights, the optimizer state, the scheduler and, on the same world
size, the random state. twinkle's ``Trainer`` restores all at once (:func:`restore_step`, which also checks the
checkpoint against the run); the ``transformers.Trainer`` mixin and the swift plugin at HF's two seams
(``_load_from_checkpoint``: :func:`restore_weights`; ``_load_optimizer_and_scheduler``:
:func:`restore_trainer_state`). A front-end's own progress (its step counter and log history) stays its own.
"""

from __future__ import annotations

import enum
import os

from torch import nn

from twinkle_strategy.checkpoint.directories import PENDING_SUFFIX, raise_if_incomplete
from twinkle_strategy.checkpoint.reading import STATE_DIR
from twinkle_strategy.checkpoint.training import load_checkpoint, load_trained_weights, load_trainer_state
from twinkle_strategy.errors import ResumeError


class Restored(enum.Enum):
    """A part of the training state a resumed step continues from."""

    TRAINED_WEIGHTS = "the trained weights: an adapter run's trainable weights (trainer_state/), else the model"
    OPTIMIZER = "the optimizer state, each rank its own rows (trainer_state/)"
    SCHEDULER = "the learning-rate scheduler (trainer_state/scheduler.pt)"
    RNG = "the random state, on the same world size only (trainer_state/rng/)"


RESTORED = tuple(Restored)  # what every front-end's resumed step restores


def refuse_unfinished(checkpoint: str) -> None:
    """A ``checkpoint-N.tmp`` directory, or one holding the incomplete marker, is a save that never finished. (A
    pending directory holds the marker only once its writer has begun: its name alone says it is not complete.)"""
    if os.path.basename(os.path.normpath(checkpoint)).endswith(PENDING_SUFFIX):
        raise ResumeError(f"{checkpoint} is an incomplete save (killed, or still being written, before it was "
                          f"renamed to its final name): resume from a complete checkpoint-N next to it instead")
    raise_if_incomplete(checkpoint, ResumeError)


def has_trainer_state(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds ``trainer_state/`` (saved through the strategy, not with weights only)."""
    return os.path.isdir(os.path.join(checkpoint, STATE_DIR))


def restore_weights(checkpoint: str, *, model: nn.Module, strategy) -> bool:
    """:attr:`Restored.TRAINED_WEIGHTS` of a finished ``checkpoint`` into ``model``'s shards; False (nothing read)
    where it has no ``trainer_state/``: the front-end says what that means for it."""
    refuse_unfinished(checkpoint)
    if not has_trainer_state(checkpoint):
        return False
    load_trained_weights(checkpoint, model, strategy.ep_plan)
    return True


def restore_trainer_state(checkpoint: str, *, model: nn.Module, strategy, optimizer, scheduler) -> bool:
    """:attr:`Restored.OPTIMIZER`, :attr:`Restored.SCHEDULER` and :attr:`Restored.RNG` of ``checkpoint``; False
    (nothing read) where it has no ``trainer_state/``."""
    if not has_trainer_state(checkpoint):
        return False
    load_trainer_state(checkpoint, model, strategy.ep_plan, optimizer=optimizer, scheduler=scheduler)
    return True


def restore_step(checkpoint: str, *, model: nn.Module, strategy, optimizer, scheduler, expect: dict) -> dict:
    """Everything :data:`RESTORED` lists, at once, from a checkpoint twinkle's ``Trainer`` saved; its saved
    trainer state (the front-end's progress). ``expect``: what must match the run (e.g. the global batch)."""
    return load_checkpoint(checkpoint, model, strategy, optimizer=optimizer, scheduler=scheduler, expect=expect)
