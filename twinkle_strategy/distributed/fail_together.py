"""Fail together: an error on one rank becomes the same clear error on every rank.

In a collective program, a rank that raises alone leaves the others waiting in
their next collective until a timeout, or forever. Every step that can fail on
some ranks only (reading a checkpoint, writing one, checking shapes) ends with
:func:`raise_together` instead of a plain barrier; :func:`collectively` runs
such a step and ends it so. When a peer died or hung instead of failing, the
ranks that are left name it from :mod:`twinkle_strategy.distributed.liveness`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from twinkle_strategy.distributed.messages import all_gather_objects, collective_device
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.errors import DistributedInitError, RanksFailedError, shorten

StepDone = Callable[[BaseException | None, str], None]
T = TypeVar("T")


def raise_together(error: BaseException | str | None, what: str,
                   error_class: type[RanksFailedError] = RanksFailedError, *, advice: str = "") -> None:
    """Collective: if any rank passes an error, every rank raises ``error_class`` naming all failing ranks.

    Each rank calls this at the same point; a rank that failed calls it with
    its exception instead of skipping ahead, so nobody waits for it forever.
    """
    message = None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Tensor collectives on the backend's device (HCCL has no object collectives).
        gathered = all_gather_objects((dist.get_rank(), message))
    else:
        gathered = [(0, message)]
    failures = [(rank, msg) for rank, msg in gathered if msg is not None]
    if failures:
        detail = shorten((f"rank {rank}: {msg}" for rank, msg in failures), 8, "; ")
        advice = f"; {advice}" if advice else ""
        err = error_class(f"{what} failed on rank(s) {[r for r, _ in failures]}: {detail}{advice}", failures)
        if isinstance(error, BaseException):
            raise err from error
        raise err


def raise_init_together(error: BaseException | str | None, what: str) -> None:
    """:func:`raise_together` raising :class:`DistributedInitError`: the error of loading a model and of
    memory_efficient_init."""
    raise_together(error, what, DistributedInitError)


def collectively(what: str, action: Callable[[], T], *, here: bool = True,
                 error_class: type[RanksFailedError] = RanksFailedError) -> T | None:
    """``action()`` on the ranks where ``here`` is true, then :func:`raise_together`: if it raised on any
    rank, every rank raises ``error_class`` naming them all. Collective: every rank calls it at the same
    point. Returns what ``action`` returned (None where it did not run).
    """
    result, error = None, None
    if here:
        try:
            result = action()
        except Exception as exc:  # noqa: BLE001 - reported on every rank by raise_together, just below
            error = exc
    raise_together(error, what, error_class)
    return result


def on_rank0(action: Callable[[], object]) -> BaseException | None:
    """Run ``action`` on global rank 0 only; return its exception (for :func:`raise_together`) instead of raising."""
    if global_rank() != 0:
        return None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller's raise_together
        return exc
    return None


def step_reporter(subject: str, *, error_class: type[RanksFailedError] = RanksFailedError, advice: str = "",
                  cleanup: Callable[[], None] | None = None) -> StepDone:
    """``step_done(error, what)``: the check that ends each step of a collective job such as a save.

    Every rank calls it after each step with its own error or None; if any rank failed, rank 0 runs
    ``cleanup`` (e.g. removes a half-written directory) and every rank raises ``error_class``.
    """
    def step_done(error: BaseException | None, what: str) -> None:
        try:
            raise_together(error, f"{subject} ({what})", error_class, advice=advice)
        except RanksFailedError:
            if cleanup is not None and global_rank() == 0:
                cleanup()
            raise

    return step_done


class FoldedSteps:
    """A :data:`StepDone` that only notes each step's error; :meth:`finish` is the one fail-together check of all.

    For a sequence of steps that never needs a peer's result before the next (an asynchronous save's host copies:
    copies into host memory, collectives every rank runs whatever its own errors): one collective instead of
    one per step. The first error is the one reported, prefixed by its step.
    """

    def __init__(self, step_done: StepDone, what: str) -> None:
        """``step_done``: a :func:`step_reporter`'s; ``what``: the name of the folded steps, the same on every rank."""
        self._step_done, self._what = step_done, what
        self._error: str | None = None

    def __call__(self, error: BaseException | None, what: str) -> None:
        if error is not None and self._error is None:
            self._error = f"{what}: {type(error).__name__}: {error}"

    def finish(self) -> None:
        """Collective: raise on every rank (through the wrapped ``step_done``) if any step failed on any rank.

        One ``all_reduce`` of a flag when all went well (what an asynchronous save costs training); the messages
        are gathered only when some rank failed."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            failed = torch.tensor([self._error is not None], dtype=torch.int64, device=collective_device())
            dist.all_reduce(failed)
            if not int(failed.item()):
                return
        self._step_done(self._error, self._what)
