"""Naming the rank that died: a tiny status board in the job's key-value store.

When a collective fails because a peer died (connection closed) or hung
(timeout), the surviving ranks only see "peer gone". Each rank therefore
records in the store when it finishes a phase of the init, or why it failed;
a rank that hits a failure waits a moment for the others' records and names
the ranks that left none: those processes died or hung.

The store is torch.distributed's default store (torchrun's, which lives in the
agent process and survives the workers). There is no public accessor for it,
so this is the one place that reaches for the private one.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from twinkle_strategy.runtime import global_rank


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: we simply cannot name ranks
        return None


class StatusBoard:
    """Status records of one collective activity (one init, one training run).

    Every rank creates its boards in the same order, so the n-th board named
    ``name`` gets the same key namespace on every rank and never sees the
    records of an earlier one.
    """

    _created: dict[str, int] = {}

    def __init__(self, name: str):
        StatusBoard._created[name] = StatusBoard._created.get(name, 0) + 1
        self.namespace = f"{name}{StatusBoard._created[name]}"
        self.store = _store()
        self.rank = global_rank()
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def _key(self, what: str, rank: int) -> str:
        return f"twinkle/{self.namespace}/{what}/{rank}"

    def _set(self, what: str, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self._key(what, self.rank), value)
        except Exception:  # noqa: BLE001 - the store itself may be gone with a dead node
            pass

    def finished(self, phase: str) -> None:
        self._set(f"finished-{phase}", "1")

    def failed(self, reason: str) -> None:
        self._set("failed", reason[:500])

    def silent_ranks(self, phase: str, grace_s: float = 3.0) -> list[int] | None:
        """Ranks that neither finished ``phase`` nor reported a failure (None if the store is unreachable)."""
        if self.store is None:
            return None
        deadline = time.monotonic() + grace_s
        try:
            self.store.set_timeout(datetime.timedelta(seconds=1))
            while True:
                silent = [r for r in range(self.world)
                          if not self.store.check([self._key(f"finished-{phase}", r)])
                          and not self.store.check([self._key("failed", r)])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            return None
