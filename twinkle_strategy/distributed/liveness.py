"""Naming the rank that died: a tiny status board in the job's key-value store.

When a collective fails because a peer died (connection closed) or hung
(timeout), the surviving ranks only see "peer gone". Each rank therefore
records in the store how far it got (the number of phases it finished), or why
it failed; a rank that hits a failure waits a moment for the others' records
and names the ranks that did not get as far: those processes died or hung
(:meth:`StatusBoard.who_stopped`, in the same words for the init and the trainer).

Bounded, whatever the length of the run: one key per rank, overwritten at
every phase (a training run finishes a phase per step), and a probe reads all
of them with one ``check`` and one ``multi_get``. Rank 0 creates every key when
the board is made, so that read does not wait for the key of a rank that died
before its first record; the store's timeout is never touched.

The store is torch.distributed's default store (torchrun's, which lives in the
agent process and survives the workers). There is no public accessor for it,
so this is the one place that reaches for the private one.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from twinkle_strategy.compat.torch_internals import default_store
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.errors import InternalChangedError

NOT_STARTED = "0"
# How a failure record starts when the rank failed only because a peer did (its collective lost the peer):
# who_stopped names the peers' own failures, the causes, before (or instead of) these.
AFTER_PEER = "after a peer: "


def _store():
    try:
        return default_store()
    except InternalChangedError:
        raise
    except Exception:  # noqa: BLE001 - no store: we simply cannot name ranks
        return None


class StatusBoard:
    """Status records of one collective activity (one init, one training run).

    Every rank creates its boards in the same order, so the n-th board named
    ``name`` gets the same key namespace on every rank and never sees the
    records of an earlier one. A record is ``"{phases finished}"`` or
    ``"{phases finished} failed: {reason}"``. ``namespace`` names the keys
    instead (boards of several ranks made in one process share it).
    """

    _created: dict[str, int] = {}

    def __init__(self, name: str, *, store=None, rank: int | None = None, world: int | None = None,
                 namespace: str | None = None):
        if namespace is None:
            StatusBoard._created[name] = StatusBoard._created.get(name, 0) + 1
            namespace = f"{name}{StatusBoard._created[name]}"
        self.namespace = namespace
        self.store = _store() if store is None else store
        self.rank = global_rank() if rank is None else rank
        self.world = (dist.get_world_size() if dist.is_initialized() else 1) if world is None else world
        self.finished_phases = 0
        self._try(self._create_keys)

    def _key(self, rank: int) -> str:
        return f"twinkle/{self.namespace}/{rank}"

    @property
    def keys(self) -> list[str]:
        return [self._key(r) for r in range(self.world)]

    def _create_keys(self) -> None:
        # compare_set creates a missing key and never overwrites a record a fast rank already made.
        for key in self.keys if self.rank == 0 else [self._key(self.rank)]:
            self.store.compare_set(key, "", NOT_STARTED)

    def _try(self, action):
        if self.store is None:
            return None
        try:
            return action()
        except Exception:  # noqa: BLE001 - the store itself may be gone with a dead node
            return None

    def finished(self, phase: str) -> None:
        self.finished_phases += 1
        self._try(lambda: self.store.set(self._key(self.rank), str(self.finished_phases)))

    def failed(self, reason: str, *, after_peer: bool = False) -> None:
        """Record this rank's failure; ``after_peer``: it failed because a peer did (a collective lost the peer)."""
        reason = f"{AFTER_PEER if after_peer else ''}{reason[:500]}"
        self._try(lambda: self.store.set(self._key(self.rank), f"{self.finished_phases} failed: {reason}"))

    def failures(self) -> list[tuple[int, str]]:
        """(rank, reason) of every rank that recorded a failure on this board (empty if the store is gone)."""
        records = self._try(self._records) or []
        return [(r, record.partition(" failed: ")[2]) for r, record in enumerate(records)
                if record is not None and " failed: " in record]

    def silent_ranks(self, phase: str, grace_s: float = 3.0) -> list[int] | None:
        """Ranks that neither finished ``phase`` (the one this rank is in) nor reported a failure (None if the
        store is unreachable). Polls for ``grace_s`` seconds: the others may be about to report."""
        if self.store is None:
            return None
        deadline = time.monotonic() + grace_s
        while True:
            records = self._try(self._records)
            if records is None:
                return None
            silent = [r for r, record in enumerate(records) if record is None or not self._reported(record)]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.2)

    def who_stopped(self, phase: str, grace_s: float = 3.0) -> tuple[str, list[tuple[int, str]]]:
        """What this rank can tell when a collective of ``phase`` failed under it: the other ranks that failed
        (and why) or fell silent, as a phrase for its error message and as ``(rank, reason)`` pairs. The ranks
        that failed on their own come first; those that failed only after a peer are named when nobody else is."""
        failed = [(r, why) for r, why in self.failures() if r != self.rank]
        causes = [(r, why) for r, why in failed if not why.startswith(AFTER_PEER)]
        after_peer = [(r, why) for r, why in failed if why.startswith(AFTER_PEER)]
        silent = self.silent_ranks(phase, grace_s) or []
        parts = [f"rank {r} failed: {why}" for r, why in causes[:8]]
        if not causes:
            parts += [f"rank {r} failed after a peer ({why.removeprefix(AFTER_PEER)})" for r, why in after_peer[:8]]
        if silent:
            parts.append(f"rank(s) {silent} did not report back (one of them died or hung; see their logs)")
        named = causes + after_peer + [(r, "did not report back") for r in silent]
        return "; ".join(parts) or "a peer stopped responding", named

    def _records(self) -> list[str | None]:
        """Every rank's record (None: none yet), without waiting for a key."""
        keys = self.keys
        if self.store.check(keys):  # the usual case: one check, one read
            return [value.decode() for value in self.store.multi_get(keys)]
        # A rank died before its first record while rank 0 could not create the keys: find which, key by key.
        return [self.store.get(key).decode() if self.store.check([key]) else None for key in keys]

    def _reported(self, record: str) -> bool:
        finished, _, failure = record.partition(" failed: ")
        return bool(failure) or int(finished) > self.finished_phases
