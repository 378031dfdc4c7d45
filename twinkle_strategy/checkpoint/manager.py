"""A run's checkpoints: where they go, how many stay, which one a run resumes from.

The trainer's side of :mod:`twinkle_strategy.checkpoint.training`, as torchtitan's
``CheckpointManager``: the trainer says *when* (a step) and *what* (its state);
the manager owns ``<folder>/checkpoint-{step}``, the interval, rotation
(``save_total_limit``) and the choice of the checkpoint to resume from, the newest
complete one. A checkpoint counts once its ``trainer_state.json`` is written and it
carries no incomplete marker (see :mod:`twinkle_strategy.checkpoint.directories`), so a
save killed midway is never resumed from and never counts towards the limit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from typing import TYPE_CHECKING

import torch.distributed as dist

from twinkle_strategy.checkpoint.background import AsyncSaves, BackgroundWrite, InFlightSave
from twinkle_strategy.checkpoint.directories import is_incomplete
from twinkle_strategy.checkpoint.save_plan import CHUNK_BYTES, SavePlan, SaveReport, execute_save
from twinkle_strategy.checkpoint.training import (
    STATE_FILE,
    CheckpointedStrategy,
    checkpoint_items,
    load_checkpoint,
)
from twinkle_strategy.checkpoint.writing import DEFAULT_MAX_FILE_BYTES
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


def rotate_checkpoints(folder: str, keep: int | None, *, best: str | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints; call it once the newest is durable.

    ``best`` (the HF Trainer's ``best_model_checkpoint``) stays too, as the HF Trainer keeps it: second to last,
    so a limit of 1 keeps both it and the newest. Incomplete directories are neither counted nor removed.
    """
    if not keep or keep <= 0:
        return
    paths = [path for _, path in complete_checkpoints(folder)]
    if best is not None and best in paths and best != paths[-1]:
        paths.remove(best)
        paths.insert(len(paths) - 1, best)
        keep = max(keep, 2)
    for path in paths[:-keep]:
        # Renamed first: a kill during the removal must not leave a half-deleted checkpoint-N behind.
        # Only rank 0 rotates, so a failure here must not raise (the others would wait for it): it is logged.
        try:
            shutil.rmtree(path + ".old", ignore_errors=True)
            os.rename(path, path + ".old")
            shutil.rmtree(path + ".old", ignore_errors=True)
        except OSError as exc:
            logger.warning("could not remove the old checkpoint %s: %s", path, exc)


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When and how a run saves (what :class:`CheckpointManager` takes besides the objects it saves).

    ``interval``: save every that many steps (0: only when the trainer asks, e.g. at the end).
    ``keep_latest``: complete checkpoints kept (None: all). ``save_optimizer=False`` writes the weights only
    (smaller, but a run cannot resume from it). ``max_file_bytes``: of each safetensors file. ``chunk_bytes``:
    rows written at a time. ``async_save``: written in the background (see :class:`CheckpointManager`);
    ``pin_memory``: its host copies in pinned memory (GPUs and NPUs).
    """

    interval: int = 0
    keep_latest: int | None = None
    save_optimizer: bool = True
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    chunk_bytes: int = CHUNK_BYTES
    async_save: bool = False
    pin_memory: bool = False


class CheckpointManager:
    """Saves ``checkpoint-{step}`` under ``folder``, keeps the newest ``policy.keep_latest``, finds what to resume
    from. ``save`` and ``resume_path`` are collective: every rank calls them.

    ``policy.async_save``: ``save`` returns once every rank has copied its share into host memory; a background
    thread writes the files (:mod:`twinkle_strategy.checkpoint.background`). The caller then calls
    :meth:`poll` at every step boundary (collective; it raises a failed background write on every rank)
    and :meth:`wait` before it exits. One save is in flight at a time: the next waits for it.
    """

    def __init__(self, folder: str, *, model: nn.Module, strategy: CheckpointedStrategy, optimizer=None,
                 scheduler=None, tokenizer=None, policy: CheckpointPolicy = CheckpointPolicy()) -> None:
        self.folder = folder
        self.model, self.strategy, self.optimizer, self.scheduler = model, strategy, optimizer, scheduler
        self.tokenizer, self.policy = tokenizer, policy
        self.async_saves = (AsyncSaves(pin_memory=policy.pin_memory, timeout_s=getattr(strategy, "timeout_s", None))
                            if policy.async_save else None)

    @property
    def in_flight(self) -> InFlightSave | None:
        return self.async_saves.in_flight if self.async_saves is not None else None

    @property
    def finished_writes(self) -> list[BackgroundWrite]:
        """The background writes of this run's finished asynchronous saves, oldest first (file names and times)."""
        return self.async_saves.finished_writes if self.async_saves is not None else []

    def path(self, step: int) -> str:
        return checkpoint_path(self.folder, step)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, oldest first."""
        return [step for step, _ in complete_checkpoints(self.folder)]

    def should_save(self, step: int) -> bool:
        return self.policy.interval > 0 and step % self.policy.interval == 0

    def save(self, step: int, trainer_state: dict) -> SaveReport:
        """Write ``checkpoint-{step}`` (atomically, every rank its share), then rotate; this rank's report.

        Asynchronous: wait for the save in flight, copy this one into host memory and start writing it in the
        background; the report's ``seconds`` is the time training was blocked (the wait included).
        """
        policy = self.policy
        items = checkpoint_items(self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                 trainer_state=trainer_state, tokenizer=self.tokenizer,
                                 save_optimizer=policy.save_optimizer)
        plan = SavePlan(self.path(step), items, max_file_bytes=policy.max_file_bytes, chunk_bytes=policy.chunk_bytes,
                        after_publish=lambda: rotate_checkpoints(self.folder, policy.keep_latest))
        return execute_save(plan, model=self.model, ep_plan=self.strategy.ep_plan, background=self.async_saves)

    def poll(self) -> None:
        """Collective, at a step boundary: note a finished background save; raise a failed one on every rank."""
        if self.async_saves is not None:
            self.async_saves.poll()

    def wait(self) -> float:
        """Collective: wait until the save in flight (if any) is durable; the seconds waited."""
        return self.async_saves.wait() if self.async_saves is not None else 0.0

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
