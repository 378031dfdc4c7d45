"""Asynchronous saves: a thread writes the host copies while training goes on; one save in flight at a time.

What the trainers share (twinkle's own :class:`~twinkle_strategy.checkpoint.manager.CheckpointManager`, and the
``transformers.Trainer`` mixin that HF Trainer, TRL and ms-swift use) is :class:`AsyncSaves`: the save executor
(:func:`~twinkle_strategy.checkpoint.save_plan.execute_save`) calls :meth:`AsyncSaves.begin`, copies the save's
items into the returned :class:`~twinkle_strategy.checkpoint.host_copies.HostCopies`, then :meth:`AsyncSaves.start`
with what rank 0 does to commit; the training loop calls :meth:`AsyncSaves.poll` at every step boundary
(collective: a failed background write raises there on every rank) and :meth:`AsyncSaves.wait` before it ends.

Once every rank has copied its share (:mod:`twinkle_strategy.checkpoint.host_copies`)
for the checkpoint's pending directory (created empty, nothing else yet), each rank
starts a :class:`BackgroundWrite`: a thread that first exchanges the tensors written whole by their owner
(expert LoRA's ``lora_B`` and its optimizer state: from host copies, on a gloo group of the save's own, as torch
DCP's ``async_save`` coordinates on one, so that nothing interleaves with training's collectives), then writes its
deferred small files, then its pieces (headers included) into the files, creating them, and fsyncs each. The
writers never wait for one another otherwise; instead, at every step boundary the training loop calls
:meth:`InFlightSave.poll`, one small ``all_reduce`` of three counters:

* a rank whose thread failed (disk full, permissions) makes every rank stop its
  thread and raise the same :class:`~twinkle_strategy.errors.CheckpointSaveError`,
  naming that rank and file; the pending directory is removed;
* once every rank has written its share, rank 0 commits in a thread of its own:
  what needs every rank's files (an adapter read back from the trainable weights
  all ranks wrote), ``trainer_state.json``, fsync of the whole directory, the
  rename to its final name (:mod:`twinkle_strategy.checkpoint.directories`), then rotation;
* once rank 0 has committed, the save is over.

A process killed at any point leaves at most the pending directory, which
resume never takes for a checkpoint.

Why not torch DCP's ``async_save``: its storage writers write DCP's own files
(per-rank ``.distcp`` files, or ``HuggingFaceStorageWriter``'s per-rank shards
that a consolidation then reads back whole); this package writes the final
Hugging Face files in place, each rank its rows. What ``async_save`` adds on
top, host copies in pinned memory and a background thread whose only
collective happens at the end, is what this module and ``host_copies.py`` do for
these files.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from twinkle_strategy.checkpoint.directories import abandon_pending, pending_path
from twinkle_strategy.checkpoint.host_copies import CopiedPiece, DeferredWrite, HostCopies
from twinkle_strategy.checkpoint.writing import write_at
from twinkle_strategy.distributed import teardown
from twinkle_strategy.distributed.fail_together import step_reporter
from twinkle_strategy.distributed.messages import collective_device
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.errors import CheckpointSaveError

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0  # at interpreter exit, how long a writer still in flight may take to stop after its piece


@dataclasses.dataclass(frozen=True)
class FileTimes:
    """When the background writer wrote one file (``time.time()``): its first byte, and its fsync returned."""

    first_write: float
    durable: float


class BackgroundWrite:
    """One rank's share of one checkpoint, written from host memory by a thread of its own.

    First the deferred whole files, then the copied pieces, file by file: each file (and its directory) is
    created by whichever rank's writer gets there first, never truncated, and the rank that copied its
    header gives it its final size; each writer fsyncs what it wrote.
    """

    def __init__(self, name: str, pieces: list[CopiedPiece], deferred: list[DeferredWrite] = (),
                 sizes: dict[str, int] | None = None, exchanges: list[DeferredWrite] = ()) -> None:
        self.name = name
        self.pieces, self.deferred, self.sizes = pieces, list(deferred), dict(sizes or {})
        self.exchanges = list(exchanges)
        self.error: str | None = None  # "<file>: <error>", as every rank will read it
        self.file_times: dict[str, FileTimes] = {}
        self.started_at: float | None = None  # time.time() when the thread began, and when it had written all
        self.finished_at: float | None = None
        self.finished = threading.Event()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"twinkle-save-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self, *, timeout_s: float | None = None) -> None:
        """Stop after the piece being written (another rank failed: this save is abandoned); ``timeout_s``: how long
        to wait for the thread (default: until it stops)."""
        self._cancelled.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        self.started_at = time.time()
        path = "the tensors written whole by their owner"
        try:
            self._run_exchanges()
            for deferred in self.deferred:
                path = deferred.what
                deferred.action()
            by_file: dict[str, list[CopiedPiece]] = {}  # a file's pieces may be copied between another's
            for piece in self.pieces:
                by_file.setdefault(piece.path, []).append(piece)
            for path, pieces in by_file.items():
                self._write_file(path, pieces)
                if self._cancelled.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - reported on every rank at the next step boundary
            self.error = f"writing {path}: {type(exc).__name__}: {exc}"
        finally:
            # The buffers belong to the host copies: the next save reuses them.
            self.pieces, self.deferred, self.exchanges = [], [], []
            self.finished_at = time.time()
            self.finished.set()

    def _run_exchanges(self) -> None:
        """Every exchange, in order: collectives on the save's own group, which every rank's writer runs whatever
        failed (a peer would wait forever in one this rank skipped); the first failure is raised after."""
        failure = None
        for exchange in self.exchanges:
            try:
                exchange.action()
            except Exception as exc:  # noqa: BLE001 - raised once every exchange has run
                failure = failure or exc
        if failure is not None:
            raise failure

    def _write_file(self, path: str, pieces: list[CopiedPiece]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Not truncated: another rank's writer may have written its rows into it already.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            first = time.time()
            for piece in pieces:
                write_piece(fd, piece)
                if self._cancelled.is_set():
                    return
            size = self.sizes.get(path)
            if size is not None and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # only grows it: every byte any rank writes lies below the planned size
            os.fsync(fd)  # by its writer: on a shared filesystem another node's fsync may not cover it
            self.file_times[os.path.basename(path)] = FileTimes(first, time.time())
        finally:
            os.close(fd)


def write_piece(fd: int, piece: CopiedPiece) -> None:
    """The one place the background writer writes bytes (looked up at each call: tests wrap it to inject a full disk
    or to pause a writer mid-file)."""
    write_at(fd, piece.data.numpy(), piece.offset)


class InFlightSave:
    """An asynchronous save after its host copies: this rank's writer thread, then rank 0's commit (collective polls).

    ``commit``: what makes the checkpoint durable under its final name once every rank has written its
    share, then rotates; rank 0 alone runs it, in a thread of its own.
    """

    def __init__(self, path: str, host_copies: HostCopies, *, commit: Callable[[], None],
                 started: float | None = None) -> None:
        """``started``: ``time.time()`` when the save began (training's blocked part included); default now."""
        self.path = path
        self.name = os.path.basename(path)
        self.write = BackgroundWrite(self.name, host_copies.pieces, host_copies.deferred, host_copies.sizes,
                                     host_copies.exchanges)
        self.started = started if started is not None else time.time()
        self.commit_seconds: float | None = None  # rank 0: the commit's duration (its actions, fsync, rename)
        self.durable_at: float | None = None  # rank 0: time.time() once the checkpoint has its final name
        self._at_commit = list(host_copies.at_commit)
        self._commit = commit
        self._commit_thread: threading.Thread | None = None
        self._commit_error: str | None = None
        self._committed = threading.Event()
        self.write.start()

    def poll(self) -> bool:
        """Collective, at a step boundary: True once the checkpoint is durable under its final name.

        Raises :class:`CheckpointSaveError` on every rank if any rank's writer (or rank 0's commit) failed.
        """
        main = global_rank() == 0
        failed = self.write.error is not None or (main and self._commit_error is not None)
        distributed = dist.is_initialized()  # (one process without a process group: nothing to agree on)
        counts = torch.tensor([not self.write.finished.is_set(), failed, main and not self._committed.is_set()],
                              dtype=torch.int64, device=collective_device() if distributed else "cpu")
        if distributed:
            dist.all_reduce(counts)
        unwritten, failures, uncommitted = counts.tolist()
        if failures:
            self._fail()
        if not unwritten and main and self._commit_thread is None:
            self._commit_thread = threading.Thread(target=self._run_commit, name=f"twinkle-commit-{self.name}",
                                                   daemon=True)
            self._commit_thread.start()
        return not unwritten and not uncommitted

    def wait(self, *, poll_s: float = 0.05) -> float:
        """Collective: poll until the checkpoint is durable; the seconds it took."""
        start = time.perf_counter()
        while not self.poll():
            time.sleep(poll_s)
        return time.perf_counter() - start

    def _run_commit(self) -> None:
        start, what = time.time(), ""
        try:
            for action in self._at_commit:
                what = f", writing {action.what}"
                action.action()
            what = ""
            self._commit()
            self.durable_at = time.time()
        except Exception as exc:  # noqa: BLE001 - reported on every rank at the next step boundary
            self._commit_error = f"committing {self.path}{what}: {type(exc).__name__}: {exc}"
        finally:
            self.commit_seconds = time.time() - start
            self._committed.set()

    def _fail(self) -> None:
        self.write.cancel()  # every rank stops writing before rank 0 removes the directory
        if self._commit_thread is not None:
            self._commit_thread.join()
        error = self.write.error or self._commit_error
        step_done = step_reporter(f"saving {self.name} in the background", error_class=CheckpointSaveError,
                                  advice="previous checkpoints are untouched",
                                  cleanup=lambda: abandon_pending(self.path))
        step_done(error, "writing the copied files")
        raise AssertionError("unreachable: a rank reported a failure")  # step_done raised on every rank


@dataclasses.dataclass(frozen=True)
class Wait:
    """A save that came while the previous one was still being written, and how long it waited for it."""

    previous: str
    saving: str
    seconds: float


class AsyncSaves:
    """A run's asynchronous saves (every rank holds one; its collective methods are called on every rank)."""

    def __init__(self, *, pin_memory: bool, timeout_s: float | None = None) -> None:
        """``pin_memory``: copy into pinned host memory (GPUs and NPUs). ``timeout_s``: of the background writers'
        exchanges (a peer that died mid-exchange), default torch's."""
        self.host_copies = HostCopies(pin_memory=pin_memory)
        self.timeout_s = timeout_s
        self.in_flight: InFlightSave | None = None
        # This run's finished saves, oldest first (their buffers are back in the host copies): file names and
        # times of each rank's writer, and, on rank 0, how long its commit took.
        self.finished: list[InFlightSave] = []
        self.waits: list[Wait] = []
        self._started: float | None = None
        self._room_for: str | None = None  # the save whose predecessor was waited for (make_room)

    @property
    def finished_writes(self) -> list[BackgroundWrite]:
        return [save.write for save in self.finished]

    def make_room(self, path: str) -> None:
        """Collective: wait for the save in flight (logged when there was one) before ``path`` is declared (a
        front-end whose items read what the previous save publishes calls it first; :meth:`begin` otherwise)."""
        if self._room_for == path:
            return
        self._room_for, self._started = path, time.time()
        previous = self.in_flight.name if self.in_flight is not None else None
        waited = self.wait()
        if previous is not None:
            self.waits.append(Wait(previous, os.path.basename(path), waited))
            if global_rank() == 0:
                logger.info("waited %.2fs for %s to finish writing before saving %s", waited, previous,
                            os.path.basename(path))

    def begin(self, path: str) -> HostCopies:
        """Collective: :meth:`make_room` for ``path``, then start copying it into host memory."""
        self.make_room(path)
        if self.host_copies.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Collective, once: the background writers' own group, on the host, never used by training (as torch
            # DCP's async_save keeps its own gloo group): their exchanges cannot interleave with training's.
            timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s else None
            self.host_copies.group = dist.new_group(backend="gloo", timeout=timeout)
            # Before that group and the process group are destroyed at exit: no writer left using them.
            saves = weakref.ref(self)  # (the stop must not keep the run's host buffers alive)
            teardown.on_exit(lambda: saves() is not None and saves().stop_at_exit(),
                             what="the background checkpoint writers")
        self.host_copies.begin()
        return self.host_copies

    def start(self, path: str, *, commit: Callable[[], None]) -> None:
        """Once every rank has copied ``path`` (the caller's fail-together check passed): start this rank's
        writer; ``commit`` is what rank 0 runs once every rank's writer has written its share."""
        self.host_copies.end()
        self.in_flight = InFlightSave(path, self.host_copies, commit=commit, started=self._started)
        self._room_for = None

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

    def stop_at_exit(self, *, timeout_s: float = EXIT_WAIT_S) -> None:
        """The process is ending (its front-end did not :meth:`wait`, e.g. after an error): a save still in flight
        is stopped after the piece being written and left pending (resume never takes it), so that no writer uses
        a group while it is destroyed; the save's own group is let go."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            logger.warning("the process is ending with %s still being written: left pending (%s), not a "
                           "checkpoint; wait for saves before exiting", in_flight.name, pending_path(in_flight.path))
            in_flight.write.cancel(timeout_s=timeout_s)
            if in_flight._commit_thread is not None:
                in_flight._commit_thread.join(timeout_s)
        self.host_copies.group = None

    def _finished(self) -> None:
        done, self.in_flight = self.in_flight, None
        self.finished.append(done)
        if global_rank() == 0:
            logger.info("%s is complete: durable under its final name %.2fs after its save began", done.path,
                        (done.durable_at or time.time()) - done.started)
