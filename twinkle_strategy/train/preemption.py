"""Preemption and restarts: SIGTERM asks for a checkpoint at the next step boundary; torchrun restarts.

A scheduler that preempts a job (Slurm, Kubernetes, a spot instance) sends
SIGTERM and waits a grace period before SIGKILL. The handler only raises a
flag: at the end of every step the ranks agree on it (:meth:`PreemptionFlag.agreed`),
so all ranks learn of it in the same step, even when only some received the
signal, then save a checkpoint of that step together and exit 0.

The agreement is a collective on the host (gloo), not one on the device read
back with ``.item()``: that would make every step wait for the device to drain
its queue (a host sync), where the host otherwise runs ahead and keeps the
device fed. A flag raised on the host needs no device to be agreed on, and the
stop stays as timely as before: the step in which any rank got the signal.

``launch.max_restarts`` restarts failed workers in place (torchrun's
``--max-restarts``); a restarted worker continues its run directory
(:mod:`twinkle_strategy.train.run_dir`) from its newest complete checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading

from twinkle_strategy.step.collectives import any_rank

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

    def agreed(self, *, timeout_s: float | None = None) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it at every step boundary). On the host:
        no device sync (see the module's docstring). ``timeout_s``: the collective's bound."""
        return any_rank(self.requested, timeout_s=timeout_s)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
