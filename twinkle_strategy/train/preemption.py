"""Preemption and restarts: SIGTERM asks for a checkpoint at the next step boundary; torchrun restarts.

A scheduler that preempts a job (Slurm, Kubernetes, a spot instance) sends
SIGTERM and waits a grace period before SIGKILL. The handler only raises a
flag: the trainer adds it to the sums it reduces at the end of every step, so
all ranks learn of it in the same step, even when only some received the
signal, then save a checkpoint of that step together and exit 0.

``launch.max_restarts`` restarts failed workers in place (torchrun's
``--max-restarts``); a restarted worker sees ``TORCHELASTIC_RESTART_COUNT`` > 0
and resumes from the newest complete checkpoint of its run directory.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading

logger = logging.getLogger(__name__)


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 for a first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def newest_run_dir(output_dir: str) -> str | None:
    """The ``v{N}-...`` run directory with the highest N in ``output_dir`` (the one a restart continues)."""
    if not os.path.isdir(output_dir):
        return None
    runs = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := re.match(r"v(\d+)-", name))]
    return os.path.join(output_dir, max(runs)[1]) if runs else None


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
