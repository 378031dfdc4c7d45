"""What the strategy started in this process, stopped in order while Python still runs: at exit, or at shutdown().

Left to interpreter exit, the process group and the gloo groups made beside it (a node group, the host group of
``any_rank``, the background saves' own) outlive Python's finalisation: their C++ worker threads are still alive
when the interpreter is torn down, and a gloo thread that then needs the GIL is ended by the interpreter with a
forced unwind (``pthread_exit``) through C++ frames that may not unwind. That ends the process with
``terminate called without an active exception`` (SIGABRT), intermittently and on any rank, after a run whose
training and checkpoints were complete: torchrun then reports the job failed. torch documents that a program should
call ``destroy_process_group()`` before it ends; a user's script need not (``strategy.shutdown()`` is optional).

Whoever starts something that must be stopped registers the stop here (:func:`on_exit`), right after starting it;
the stops run the last registered first (threads before the groups they use, side groups before the process
group), once each, from one ``atexit`` hook, or earlier from :func:`stop_all` (``NativeFSDPStrategy.shutdown``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Stop:
    """One thing to stop: ``what`` names it in the warning a failing stop logs."""

    what: str
    action: Callable[[], None]


class Teardown:
    """Stops, run the last registered first, each once; :data:`AT_EXIT` is the process's, run by ``atexit``."""

    def __init__(self) -> None:
        self._stops: list[Stop] = []
        self._lock = threading.Lock()

    def on_exit(self, action: Callable[[], None], *, what: str) -> None:
        with self._lock:
            self._stops.append(Stop(what=what, action=action))

    def stop_all(self) -> None:
        """Run every registered stop, the last registered first, each once; one that fails is logged and the others
        still run (the process is ending: nothing is left to raise to)."""
        while True:
            with self._lock:
                if not self._stops:
                    return
                stop = self._stops.pop()
            try:
                stop.action()
            except Exception as exc:  # noqa: BLE001 - the next stops must run; a warning names what failed
                logger.warning("stopping %s failed: %s: %s", stop.what, type(exc).__name__, exc)

    def pending(self) -> list[str]:
        """What is registered and not stopped yet, the next to stop first."""
        with self._lock:
            return [stop.what for stop in reversed(self._stops)]


AT_EXIT = Teardown()
_hooked = threading.Event()  # whether atexit runs AT_EXIT (registered once per process, on the first stop)


def on_exit(action: Callable[[], None], *, what: str) -> None:
    """Run ``action`` before the interpreter exits (or at :func:`stop_all`), before every stop registered earlier."""
    AT_EXIT.on_exit(action, what=what)
    if not _hooked.is_set():
        _hooked.set()
        atexit.register(AT_EXIT.stop_all)


def stop_all() -> None:
    """Run the process's stops now (``NativeFSDPStrategy.shutdown``): the exit hook then has nothing left to do."""
    AT_EXIT.stop_all()


def pending() -> list[str]:
    """What the process has registered and not stopped yet, the next to stop first."""
    return AT_EXIT.pending()
