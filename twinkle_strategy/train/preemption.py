"""Preemption and restarts: SIGTERM asks for a checkpoint at the next step boundary; torchrun restarts.

A scheduler that preempts a job (Slurm, Kubernetes, a spot instance) sends
SIGTERM and waits a grace period before SIGKILL. The handler only raises a
flag: the trainer adds it to the sums it reduces at the end of every step, so
all ranks learn of it in the same step, even when only some received the
signal, then save a checkpoint of that step together and exit 0.

``launch.max_restarts`` restarts failed workers in place (torchrun's
``--max-restarts``); a restarted worker continues its run directory
(:mod:`twinkle_strategy.train.run_dir`) from its newest complete checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


class PreemptionFlag:
    """Set by SIGTERM; read at step boundaries. Installed only in the main thread (signal's rule)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.requested:
            logger.warning("SIGTERM: saving a checkpoint at the end of this step, then exiting")
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
