"""One run's asynchronous saves: one in flight at a time, the next waits for it, the host buffers reused.

What the trainers share (twinkle's own :class:`~twinkle_strategy.checkpoint.manager.CheckpointManager`, and the
``transformers.Trainer`` mixin that HF Trainer, TRL and ms-swift use): a save calls :meth:`AsyncSaves.begin`,
stages its files into the returned :class:`~twinkle_strategy.checkpoint.staging.HostStaging`, then
:meth:`AsyncSaves.start` with what rank 0 does to commit; the training loop calls :meth:`AsyncSaves.poll` at
every step boundary (collective: a failed background write raises there on every rank) and :meth:`AsyncSaves.wait`
before it ends.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable

import torch.distributed as dist

from twinkle_strategy.checkpoint.background import BackgroundWrite, InFlightSave
from twinkle_strategy.checkpoint.staging import HostStaging
from twinkle_strategy.distributed.runtime import global_rank

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Wait:
    """A save that came while the previous one was still being written, and how long it waited for it."""

    previous: str
    saving: str
    seconds: float


class AsyncSaves:
    """A run's asynchronous saves (every rank holds one; its collective methods are called on every rank)."""

    def __init__(self, *, pin_memory: bool, timeout_s: float | None = None) -> None:
        """``pin_memory``: stage in pinned host memory (GPUs and NPUs). ``timeout_s``: of the background writers'
        exchanges (a peer that died mid-exchange), default torch's."""
        self.staging = HostStaging(pin_memory=pin_memory)
        self.timeout_s = timeout_s
        self.in_flight: InFlightSave | None = None
        # This run's finished saves, oldest first (their buffers are back in the staging pool): file names and
        # times of each rank's writer, and, on rank 0, how long its commit took.
        self.finished: list[InFlightSave] = []
        self.waits: list[Wait] = []
        self._started: float | None = None

    @property
    def finished_writes(self) -> list[BackgroundWrite]:
        return [save.write for save in self.finished]

    def begin(self, path: str) -> HostStaging:
        """Collective: wait for the save in flight (logged when there was one), then start staging ``path``."""
        self._started = time.time()
        previous = self.in_flight.name if self.in_flight is not None else None
        waited = self.wait()
        if previous is not None:
            self.waits.append(Wait(previous, os.path.basename(path), waited))
            if global_rank() == 0:
                logger.info("waited %.2fs for %s to finish writing before saving %s", waited, previous,
                            os.path.basename(path))
        if self.staging.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Collective, once: the background writers' own group, on the host, never used by training (as torch
            # DCP's async_save keeps its own gloo group): their exchanges cannot interleave with training's.
            timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s else None
            self.staging.group = dist.new_group(backend="gloo", timeout=timeout)
        self.staging.begin()
        return self.staging

    def start(self, path: str, *, commit: Callable[[], None]) -> None:
        """Once every rank has staged ``path`` (the caller's fail-together check passed): start this rank's
        writer; ``commit`` is what rank 0 runs once every rank's writer has written its share."""
        self.staging.end()
        self.in_flight = InFlightSave(path, self.staging, commit=commit, started=self._started)

    def poll(self) -> None:
        """Collective, at a step boundary: note a finished save; raise a failed one on every rank."""
        if self.in_flight is not None and self.in_flight.poll():
            self._finished()

    def wait(self) -> float:
        """Collective: wait until the save in flight (if any) is durable under its final name; the seconds waited."""
        if self.in_flight is None:
            return 0.0
        waited = self.in_flight.wait()
        self._finished()
        return waited

    def _finished(self) -> None:
        done, self.in_flight = self.in_flight, None
        self.finished.append(done)
        if global_rank() == 0:
            logger.info("%s is complete: durable under its final name %.2fs after its save began", done.path,
                        (done.durable_at or time.time()) - done.started)
