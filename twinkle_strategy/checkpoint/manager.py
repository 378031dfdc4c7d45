"""A run's checkpoints: where they go, how many stay, which one a run resumes from.

The trainer's side of :mod:`twinkle_strategy.checkpoint.training`, as torchtitan's
``CheckpointManager``: the trainer says *when* (a step) and *what* (its state);
the manager owns ``<folder>/checkpoint-{step}``, the interval, rotation
(``save_total_limit``) and the choice of the checkpoint to resume from, the newest
complete one. A checkpoint counts once its ``trainer_state.json`` is written and it
carries no incomplete marker (see :mod:`twinkle_strategy.checkpoint.durable`), so a
save killed midway is never resumed from and never counts towards the limit.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import TYPE_CHECKING

import torch.distributed as dist

from twinkle_strategy.checkpoint.durable import is_incomplete
from twinkle_strategy.checkpoint.model_files import DEFAULT_MAX_FILE_BYTES
from twinkle_strategy.checkpoint.training import (
    CHUNK_BYTES,
    STATE_FILE,
    CheckpointedStrategy,
    SaveReport,
    load_checkpoint,
    save_checkpoint,
)
from twinkle_strategy.distributed.messages import broadcast_object

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
_NAME = re.compile(rf"{PREFIX}(\d+)")


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"{PREFIX}{step}")


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``folder``, oldest first (``.tmp`` leftovers are ignored)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    found = [(int(m.group(1)), os.path.join(folder, name)) for name in names if (m := _NAME.fullmatch(name))]
    return sorted((step, path) for step, path in found
                  if os.path.isfile(os.path.join(path, STATE_FILE)) and not is_incomplete(path))


def latest_checkpoint(folder: str) -> str | None:
    """The complete checkpoint with the highest step in ``folder``."""
    found = complete_checkpoints(folder)
    return found[-1][1] if found else None


def rotate_checkpoints(folder: str, keep: int | None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints; call it after a save returned (it is durable)."""
    if not keep:
        return
    for _, path in complete_checkpoints(folder)[:-keep]:
        # Renamed first: a kill during the removal must not leave a half-deleted checkpoint-N behind.
        # Only rank 0 rotates, so a failure here must not raise (the others would wait for it): it is logged.
        try:
            shutil.rmtree(path + ".old", ignore_errors=True)
            os.rename(path, path + ".old")
            shutil.rmtree(path + ".old", ignore_errors=True)
        except OSError as exc:
            logger.warning("could not remove the old checkpoint %s: %s", path, exc)


class CheckpointManager:
    """Saves ``checkpoint-{step}`` under ``folder``, keeps the newest ``keep_latest``, finds what to resume from.

    ``interval``: save every that many steps (0: only when the trainer asks, e.g. at the end).
    ``save_optimizer=False`` writes the weights only (smaller, but a run cannot resume from it).
    ``save`` and ``resume_path`` are collective: every rank calls them.
    """

    def __init__(self, folder: str, *, model: nn.Module, strategy: CheckpointedStrategy, optimizer=None,
                 scheduler=None, tokenizer=None, interval: int = 0, keep_latest: int | None = None,
                 save_optimizer: bool = True, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.folder = folder
        self.model, self.strategy, self.optimizer, self.scheduler = model, strategy, optimizer, scheduler
        self.tokenizer = tokenizer
        self.interval, self.keep_latest, self.save_optimizer = interval, keep_latest, save_optimizer
        self.max_file_bytes, self.chunk_bytes = max_file_bytes, chunk_bytes

    def path(self, step: int) -> str:
        return checkpoint_path(self.folder, step)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, oldest first."""
        return [step for step, _ in complete_checkpoints(self.folder)]

    def should_save(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def save(self, step: int, trainer_state: dict) -> SaveReport:
        """Write ``checkpoint-{step}`` (atomically, every rank its share), then rotate; this rank's report."""
        report = save_checkpoint(self.path(step), self.model, self.strategy, optimizer=self.optimizer,
                                 scheduler=self.scheduler, trainer_state=trainer_state, tokenizer=self.tokenizer,
                                 save_optimizer=self.save_optimizer, max_file_bytes=self.max_file_bytes,
                                 chunk_bytes=self.chunk_bytes)
        if self.strategy.is_main_process:
            rotate_checkpoints(self.folder, self.keep_latest)
        return report

    def resume_path(self, requested: str | None, *, restarted: bool) -> str | None:
        """The checkpoint this run starts from, the same on every rank (rank 0 looks).

        ``requested``: a ``checkpoint-*`` directory, or a run directory (its newest complete
        checkpoint). Without one, a run torchrun restarted continues from this folder's newest
        complete checkpoint; a fresh run starts from scratch (None).
        """
        if not requested and not restarted:
            return None
        path = None
        if self.strategy.is_main_process:
            if requested:
                is_checkpoint = os.path.basename(os.path.normpath(requested)).startswith(PREFIX)
                path = requested if is_checkpoint else latest_checkpoint(requested) or requested
            else:
                path = latest_checkpoint(self.folder)
                if path is None:
                    logger.warning("restarted: no complete checkpoint in %s yet, training from the start", self.folder)
        return broadcast_object(path, src=0) if dist.is_initialized() else path

    def load(self, path: str, *, expect: dict) -> dict:
        """Restore the model's shards, optimizer, scheduler and RNG from ``path`` (any layout of nodes, ranks
        and ep_size); return its trainer state. ``expect``: what must match, e.g. the global batch."""
        return load_checkpoint(path, self.model, self.strategy, optimizer=self.optimizer, scheduler=self.scheduler,
                               expect=expect)
