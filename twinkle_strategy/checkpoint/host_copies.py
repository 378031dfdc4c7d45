"""Host copies of what a save writes: the only part of an asynchronous save that training waits for.

An asynchronous save runs the synchronous save's own code (the same items, the
same plan, the same conversions to the hub layout, the same gathers of tensors
written whole: :mod:`twinkle_strategy.checkpoint.save_plan`) with a writer that,
instead of writing each piece into its file, copies it into a host buffer and
notes where it goes (:class:`HostCopyWriter`). The bytes
are therefore those a synchronous save writes; a background thread
(:mod:`twinkle_strategy.checkpoint.background`) writes them later.

Nothing is created on disk while training waits: the files' headers are copied
like their rows (by the rank that would create them), and the background writers
create each file and its directories as they first write into it
(:class:`HostCopyWriter`), so an asynchronous save does no file I/O at the
save step beyond one ``mkdir``.

The buffers are reused from one save to the next: the i-th piece of every save
of the same model has the same size, so it goes into the same buffer. Host
memory for the copies is one snapshot of this rank's own share, allocated at the
first save; on GPUs and NPUs it is pinned so that the device-to-host copies
run at full speed without a bounce buffer.

Why not torch DCP's stager (``torch.distributed.checkpoint.staging.DefaultStager``):
it keeps a pinned copy per *source tensor* of a state_dict, found again by
that tensor's storage. What this package writes are pieces a save produces
(per-expert slices of fused experts in the hub layout, tensors gathered whole
on their owner), new tensors at every save, so that cache would never hit and
each save would allocate a new snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch

from twinkle_strategy.checkpoint.writing import FilePlan, ParallelFileWriter


@dataclasses.dataclass(frozen=True)
class CopiedPiece:
    """Bytes waiting in host memory to be written at ``offset`` of the file ``path``."""

    path: str
    offset: int
    data: torch.Tensor  # uint8, on the host (pinned on GPUs and NPUs)


@dataclasses.dataclass(frozen=True)
class DeferredWrite:
    """A file the background writer writes whole from host data the save already copied (not a piece)."""

    what: str
    action: Callable[[], None]


class HostCopies:
    """This rank's host copies of one save's pieces, in buffers kept for the next save."""

    def __init__(self, *, pin_memory: bool, group=None) -> None:
        """``group``: a process group of every rank (gloo, on the host) the background writers exchange on; without
        one, tensors written whole are gathered at the save step."""
        self.pin_memory, self.group = pin_memory, group
        self._pool: list[torch.Tensor] = []
        self._used = 0  # buffers of the pool this save holds
        self.pieces: list[CopiedPiece] = []
        self.exchanges: list[DeferredWrite] = []
        self.deferred: list[DeferredWrite] = []
        self.at_commit: list[DeferredWrite] = []
        self.sizes: dict[str, int] = {}  # file -> its final size, for the files whose header this rank copied
        # What a save planned that the next save of the same model can reuse (file plans, this rank's regions):
        # they follow from names, shapes and dtypes only. Kept across saves, keyed by what they depend on.
        self.plans: dict = {}

    def begin(self) -> None:
        """Start a new save (the previous one's pieces must have been written: their buffers are reused)."""
        self.pieces, self.exchanges, self.deferred, self.at_commit, self.sizes = [], [], [], [], {}
        self._used = 0

    def exchange(self, what: str, action: Callable[[], None]) -> None:
        """Leave ``action``, a collective on :attr:`group` (tensors written whole by their owner, from host copies
        taken with :meth:`copy`), to the background writer. Every rank's writer runs every exchange, in the order
        they were copied (the same on every rank), before anything else and whatever fails."""
        self.exchanges.append(DeferredWrite(what, action))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` in this save's buffers, for an exchange."""
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer = self._take(data.numel())
        buffer.copy_(data, non_blocking=self.pin_memory and data.device.type != "cpu")
        return buffer.view(tensor.dtype).reshape(tensor.shape)

    def defer(self, what: str, action: Callable[[], None]) -> None:
        """Leave ``action`` (a whole file written from host data this save already owns: a config, the scheduler's
        state taken now) to the background writer, which runs it before writing the copied pieces; ``what``
        names it in an error. It must create the directories it writes into (no order between ranks' writers)."""
        self.deferred.append(DeferredWrite(what, action))

    def defer_to_commit(self, what: str, action: Callable[[], None]) -> None:
        """Leave ``action`` to the commit (rank 0, once every rank's writer has written its share, before the
        directory is sealed and renamed): what needs other ranks' files, e.g. the adapter read back whole from
        the trainable weights every rank wrote its rows of."""
        self.at_commit.append(DeferredWrite(what, action))

    def put(self, path: str, offset: int, data: torch.Tensor) -> None:
        """Copy ``data`` (uint8, any device) into the next buffer, to be written at ``offset`` of ``path``."""
        buffer = self._take(data.numel())
        buffer.copy_(data, non_blocking=self.pin_memory and data.device.type != "cpu")
        self.pieces.append(CopiedPiece(path, offset, buffer))

    def end(self) -> list[CopiedPiece]:
        """Wait for the device-to-host copies; the pieces of this save, in the order they were copied."""
        if self.pin_memory and torch.accelerator.is_available():
            torch.accelerator.synchronize()
        del self._pool[self._used:]  # no more than this save's snapshot stays allocated
        return self.pieces

    def _take(self, size: int) -> torch.Tensor:
        """The next buffer of the pool, of ``size`` bytes: the i-th of every save of the same model has one size."""
        i = self._used
        if i == len(self._pool):
            self._pool.append(self._new_buffer(size))
        elif self._pool[i].numel() != size:  # another model or plan: this position's buffer is replaced
            self._pool[i] = self._new_buffer(size)
        self._used += 1
        return self._pool[i]

    @property
    def copied_bytes(self) -> int:
        """Host bytes this save's pieces and exchange copies hold."""
        return sum(buffer.numel() for buffer in self._pool[:self._used])

    @property
    def allocated_bytes(self) -> int:
        """Host memory held for the copies: after a save, exactly what that save copied (one snapshot)."""
        return sum(buffer.numel() for buffer in self._pool)

    def open_writer(self, directory: str, plan: FilePlan) -> HostCopyWriter:
        """A writer for :data:`~twinkle_strategy.checkpoint.writing.OpenWriter`: the save's rows land here."""
        return HostCopyWriter(directory, plan, self)

    def _new_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)


class HostCopyWriter(ParallelFileWriter):
    """A :class:`ParallelFileWriter` whose rows go to host buffers, to be written by the background writer."""

    def __init__(self, directory: str, plan: FilePlan, host_copies: HostCopies) -> None:
        super().__init__(directory, plan)
        self.host_copies = host_copies

    def create_files(self) -> None:
        """Stage every header, and note every file's final size: the background writer creates the files."""
        for name, header in self.plan.headers.items():
            path = os.path.join(self.directory, name)
            self.host_copies.put(path, 0, torch.frombuffer(bytearray(header), dtype=torch.uint8))
            self.host_copies.sizes[path] = self.plan.sizes[name]

    def write_text(self, name: str, text: str) -> None:
        """Deferred to the background writer (the text is taken now)."""
        self.host_copies.defer(os.path.join(self.directory, name), functools.partial(write_text, self.directory, name, text))

    def _put(self, name: str, offset: int, data: torch.Tensor) -> None:
        self.host_copies.put(os.path.join(self.directory, name), offset, data)

    def finish(self) -> OSError | None:
        return None  # nothing was opened: the background writer opens, writes and fsyncs the files


def write_text(directory: str, name: str, text: str) -> None:
    """``directory/name`` with ``text``, creating ``directory`` (a background writer: no rank created it yet)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w") as f:
        f.write(text)
