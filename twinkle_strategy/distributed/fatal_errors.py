"""What a rank prints when an exception ends it: the root cause first, once per node.

Left to Python (and to torch.distributed's excepthook, which prefixes each line with ``[rank<R>]: ``), an error
on one rank of a ``torchrun`` job prints a traceback on every rank: the rank that failed, and each peer whose
next collective then lost it ("Connection closed by peer"). That is 70-190 lines for one message, with the
cause somewhere among them. :func:`install` (called by ``init_distributed``, so every front-end that launches
under a plain ``torchrun`` gets it: HF Trainer, TRL, a user's script) replaces that for this package's errors:

* the rank whose error it is writes its traceback to a file, records the error in the job's key-value store
  and prints one line: its rank, the error, the file;
* a rank that fails after a peer recorded an error (its collective lost the peer, or fail-together raised the
  peer's error here too) prints the peer's error, not its own connection error;
* each distinct error is printed once per node (the first rank of the node to claim it in the store says it):
  a node's terminal shows its own ranks' output, and every node's terminal names the cause; a refusal that
  every rank makes on its own is one line, not one per rank.

An exception that is not the package's (the user's code, TRL's, transformers') is a cause too, but its message
alone may not say where it came from: the first rank of a node to claim it prints its traceback (Python's own,
under one line naming the rank), the node's other ranks that raised the same print nothing more, and a rank it
stranded names it in one line as above. Only a lost connection that no peer recorded a cause for keeps the hook
that was there (Python's, or torch's).

Every rank's traceback is in ``<temp dir>/twinkle-errors-<job>/rank<R>.txt``. Under torchrun each failed rank also
writes its line to the error file torchrun gave it (``TORCHELASTIC_ERROR_FILE``): torchrun's failure report, which
its agent prints after the workers end whatever they do, then names that line instead of a link to its docs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback

from twinkle_strategy.compat.torch_internals import default_store
from twinkle_strategy.errors import RanksFailedError, TrainingAbortedError, TwinkleError

PEER_GRACE_S = 2.0  # how long a rank whose collective failed waits for the failing peer's record
SAID_WAIT_S = 3.0  # how long a rank whose line another rank of its node says waits for it to be said
# What gloo and NCCL say when a peer's process ended under a collective.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
_HOOK_MARK = "_twinkle_fatal_errors"


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where this process is in the job: what the line names and which node's terminal it goes to."""

    rank: int
    world_size: int
    node_rank: int


def failing_ranks(exc: RanksFailedError) -> list[int]:
    return [rank for rank, _ in exc.failures]


def stopped_by_peer(exc: BaseException, rank: int) -> bool:
    """Whether ``exc`` on ``rank`` is the consequence of another rank's failure, not a cause of its own: an
    aborted training step, a fail-together error this rank did not contribute to, or a collective whose peer
    process ended."""
    if isinstance(exc, TrainingAbortedError):
        return True
    if isinstance(exc, RanksFailedError):
        return rank not in failing_ranks(exc)
    if isinstance(exc, TwinkleError):
        return False
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in PEER_GONE)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


_REPORTING = {"now": False}  # a hook of ours is handling an exception (another of ours may sit inside torch's)


def install(place: RankPlace) -> None:
    """Make an exception end this rank with its root cause said once per node: one line for this package's errors,
    the traceback for another's (see the module). A no-op on one process.

    Called before the process group exists (errors raised before it: one line per rank, no store to agree
    through) and again once it does: torch then wraps the hook it finds with its own, and this one must come first.
    """
    if place.world_size <= 1 or getattr(sys.excepthook, _HOOK_MARK, False):
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if _REPORTING["now"]:  # the outer hook of ours passed it on: the inner one passes it on too
            previous(exc_type, exc, tb)
            return
        _REPORTING["now"] = True
        try:
            try:
                handled = report(exc, place)
            except Exception:  # noqa: BLE001 - a report that fails must not hide the error it reports
                handled = False
            if not handled:
                previous(exc_type, exc, tb)
        finally:
            _REPORTING["now"] = False

    setattr(excepthook, _HOOK_MARK, True)
    sys.excepthook = excepthook


def report(exc: BaseException, place: RankPlace, *, out=None, board: ErrorBoard | None = None) -> bool:
    """Write ``exc``'s traceback to its file and print what this rank says of it on ``out`` (stderr): one line, or
    for an error not the package's its traceback under one; nothing where its node said it already. False where
    ``exc`` is not for this module (a lost connection no peer recorded a cause for, Ctrl-C, sys.exit): the
    caller's hook prints it."""
    if not isinstance(exc, Exception):  # Ctrl-C, sys.exit: as Python shows them
        return False
    out = sys.stderr if out is None else out
    board = ErrorBoard.of_job() if board is None else board
    ours, stranded = isinstance(exc, TwinkleError), stopped_by_peer(exc, place.rank)
    if ours and not stranded:
        record = own_record(exc, place, board)
        board.publish(record)  # before this process ends: the peers it strands look it up
    else:
        # Only a rank a peer stranded waits for that peer's record; any other error is looked up once.
        record = board.first_failure(not_rank=place.rank, grace_s=PEER_GRACE_S if stranded else 0.0)
        if record is None and stranded and not ours:
            return False  # a lost connection, and no peer said why: as Python (or torch) shows it
        # The user's, TRL's, transformers': a cause of its own, unless a peer recorded another error first (this one
        # may be its consequence, e.g. a collective's timeout). The same error a peer raised, this rank raised too.
        if not ours and not stranded and (record is None or record.error == one_line(exc)):
            record = foreign_record(exc, place, board)
            board.publish(record)
        record = record or own_record(exc, place, board)
    board.write_traceback(place, exc)
    line = record.line if record.rank == place.rank or record.collective else (
        f"twinkle_strategy: rank {place.rank} stopped because rank {record.rank} failed: {record.error} "
        f"(tracebacks: {board.traceback_path('<R>')})")
    write_torchrun_error_file(line.splitlines()[0])
    if board.claim(place.node_rank, record.error, place.rank):
        print(line, file=out, flush=True)
        board.mark_said(place.node_rank, record.error)
    else:
        # This rank ending makes torchrun stop the node's others at once (SIGTERM): the one saying the line must
        # have said it first, or the node's terminal shows none, or half a traceback.
        board.wait_said(place.node_rank, record.error, timeout_s=SAID_WAIT_S)
    return True


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """One rank's error as the store keeps it. A node prints each distinct ``error`` once: a fail-together error
    (the same message on every rank, naming the failing ones), or a refusal every rank makes on its own."""

    rank: int
    error: str
    line: str
    collective: bool
    time: float


def own_record(exc: TwinkleError, place: RankPlace, board: ErrorBoard) -> FailureRecord:
    error = one_line(exc)
    if isinstance(exc, RanksFailedError):  # raised on every rank with the same message: one line says it for all
        line = f"twinkle_strategy: every rank stopped: {error} (tracebacks: {board.traceback_path('<R>')})"
        return FailureRecord(place.rank, error, line, True, time.time())
    line = f"twinkle_strategy: rank {place.rank}: {error} (traceback: {board.traceback_path(place.rank)})"
    return FailureRecord(place.rank, error, line, False, time.time())


def foreign_record(exc: BaseException, place: RankPlace, board: ErrorBoard) -> FailureRecord:
    """The record of an exception that is not the package's: its line is its traceback, under a line naming the
    rank (its message alone may not say where it came from)."""
    lines = (f"twinkle_strategy: rank {place.rank} failed; its traceback (every rank's: "
             f"{board.traceback_path('<R>')}):\n{''.join(traceback.format_exception(exc)).rstrip()}")
    return FailureRecord(place.rank, one_line(exc), lines, False, time.time())


def write_torchrun_error_file(line: str) -> None:
    """``line`` as this worker's failure in the error file torchrun gave it (``TORCHELASTIC_ERROR_FILE``, in the
    JSON its ``@record`` writes): torchrun's failure report shows it. Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The report shows py_callstack; a "message" that is not a dict makes torchrun warn about its format.
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun's report then says what it says without one


class ErrorBoard:
    """The records of failed ranks in the job's key-value store (torchrun's, which outlives the workers), and
    where tracebacks go. Without a store (it is gone, or there is none) it records nothing and claims every line."""

    def __init__(self, store, prefix: str, job: str):
        self.store, self.prefix = store, prefix
        self.directory = os.path.join(tempfile.gettempdir(), f"twinkle-errors-{job}")

    @classmethod
    def of_job(cls) -> ErrorBoard:
        # A restarted round (torchrun --max-restarts) keeps the store: its records must not be the last round's.
        prefix = f"twinkle/errors/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            store = default_store()
            job = store.compare_set(f"{prefix}/job", "", mine).decode()  # the first rank's name, for every rank
        except Exception:  # noqa: BLE001 - the store went with a dead agent: this rank reports on its own
            store, job = None, mine
        return cls(store, prefix, job)

    def traceback_path(self, rank: int | str) -> str:
        return os.path.join(self.directory, f"rank{rank}.txt")

    def write_traceback(self, place: RankPlace, exc: BaseException) -> str:
        path = self.traceback_path(place.rank)
        os.makedirs(self.directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"rank {place.rank} of {place.world_size} (node {place.node_rank}), pid {os.getpid()}: "
                    f"{' '.join(sys.argv)}\n")
            f.write("".join(traceback.format_exception(exc)))
        return path

    def _try(self, action, default):
        if self.store is None:
            return default
        try:
            return action()
        except Exception:  # noqa: BLE001 - the store may be gone with a dead node
            return default

    def publish(self, record: FailureRecord) -> None:
        def add() -> None:
            index = self.store.add(f"{self.prefix}/count", 1)
            self.store.set(f"{self.prefix}/failure/{index}", json.dumps(dataclasses.asdict(record)))

        self._try(add, None)

    def failures(self) -> list[FailureRecord]:
        def read() -> list[FailureRecord]:
            count = self.store.add(f"{self.prefix}/count", 0)
            keys = [f"{self.prefix}/failure/{i}" for i in range(1, count + 1)]
            keys = [key for key in keys if self.store.check([key])]  # one counted but not yet written: next poll
            return [FailureRecord(**json.loads(value)) for value in self.store.multi_get(keys)] if keys else []

        return self._try(read, [])

    def first_failure(self, *, not_rank: int, grace_s: float) -> FailureRecord | None:
        """The earliest error another rank recorded, waiting up to ``grace_s`` for one (None if none came)."""
        deadline = time.monotonic() + grace_s
        while True:
            found = [record for record in self.failures() if record.rank != not_rank]
            if found or self.store is None or time.monotonic() > deadline:
                return min(found, key=lambda record: record.time) if found else None
            time.sleep(0.1)

    def _said_key(self, node_rank: int, error: str) -> str:
        return f"{self.prefix}/said/{node_rank}/{hashlib.sha1(error.encode()).hexdigest()}"

    def claim(self, node_rank: int, error: str, rank: int) -> bool:
        """Whether this rank is the first of its node to say the line of ``error`` (True without a store)."""
        said = self._said_key(node_rank, error)
        return self._try(lambda: self.store.compare_set(said, "", str(rank)).decode() == str(rank), True)

    def mark_said(self, node_rank: int, error: str) -> None:
        """The claimed line of ``error`` is on the node's terminal."""
        self._try(lambda: self.store.set(f"{self._said_key(node_rank, error)}/done", "1"), None)

    def wait_said(self, node_rank: int, error: str, *, timeout_s: float) -> None:
        """Until the rank that claimed ``error``'s line on this node has said it, at most ``timeout_s``."""
        done = f"{self._said_key(node_rank, error)}/done"
        deadline = time.monotonic() + timeout_s
        while not self._try(lambda: self.store.check([done]), True) and time.monotonic() < deadline:
            time.sleep(0.05)
