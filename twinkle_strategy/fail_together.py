"""Fail together: an error on one rank becomes the same clear error on every rank.

In a collective program, a rank that raises alone leaves the others waiting in
their next collective until a timeout, or forever. Every step that can fail on
some ranks only (reading a checkpoint, writing one, checking shapes) ends with
:func:`raise_together` instead of a plain barrier.
"""

from __future__ import annotations

import torch.distributed as dist

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.messages import all_gather_objects


class RanksFailedError(TwinkleError):
    """One or more ranks failed; raised on every rank with every failing rank's reason."""

    def __init__(self, message: str, failures: list[tuple[int, str]]):
        super().__init__(message)
        self.failures = failures


def raise_together(error: BaseException | str | None, what: str,
                   error_class: type[RanksFailedError] = RanksFailedError) -> None:
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
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures[:8])
        more = f" (and {len(failures) - 8} more ranks)" if len(failures) > 8 else ""
        err = error_class(f"{what} failed on rank(s) {[r for r, _ in failures]}: {detail}{more}", failures)
        if isinstance(error, BaseException):
            raise err from error
        raise err
