"""Pause an asynchronous save's background writer mid-file, from outside the package, in the rank process.

The writer (twinkle_strategy/checkpoint/background.py) writes every byte through the module function ``write_piece``;
:func:`pause_save_writer` wraps it so that the writer of one checkpoint stops after the first piece it writes into
that checkpoint's pending directory, creates ``<directory>/paused.rank<R>``, and goes on once
``<directory>/release`` exists (or after :data:`PAUSE_LIMIT_S`). Tests kill ranks at that point, or check that
training went on meanwhile, so what happens while a file is half written is deterministic.

A worker that trains in its own code calls :func:`pause_save_writer` around the training. A rank whose program is the
product's (``twinkle-sft``'s ranks, through tests/workers/twinkle_sft_rank.py; ``swift sft``'s, through
tests/workers/swift_probe_plugin.py) calls :func:`pause_from_environment`: the test names the checkpoint and the
folder in ``$TWINKLE_TEST_PAUSE_SAVE_WRITER`` (``<checkpoint name>:<directory>``), which the ranks inherit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

PAUSE_ENV = "TWINKLE_TEST_PAUSE_SAVE_WRITER"
PAUSE_LIMIT_S = 120.0


@contextlib.contextmanager
def pause_save_writer(checkpoint: str, directory: str) -> Iterator[None]:
    """While inside: the background writer of ``checkpoint`` (``checkpoint-4``) pauses after its first piece."""
    from twinkle_strategy.checkpoint import background
    from twinkle_strategy.checkpoint.directories import PENDING_SUFFIX
    from twinkle_strategy.distributed.runtime import global_rank

    original = background.write_piece
    pending = f"{os.sep}{checkpoint}{PENDING_SUFFIX}{os.sep}"  # the writer writes into <checkpoint>.tmp/
    paused = threading.Event()  # once per process: a checkpoint is saved once per training process

    def write_then_pause(fd, piece):
        original(fd, piece)
        if paused.is_set() or pending not in piece.path:
            return
        paused.set()
        open(os.path.join(directory, f"paused.rank{global_rank()}"), "w").close()
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not os.path.exists(os.path.join(directory, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)

    background.write_piece = write_then_pause
    try:
        yield
    finally:
        background.write_piece = original


def release_once_every_rank_began_step_3(directory: str) -> None:
    """Each rank marks that it began step 3; rank 0 releases the paused writers once all have.

    Releasing at rank 0's own start let another rank's writer finish a file before that rank began step 3
    (CI saw it by 0.7 ms, and by 5 ms in the HF Trainer's run). Every rank writes its marker before step 3's first
    collective, so rank 0's wait cannot deadlock.
    """
    import torch.distributed as dist
    import worker_common

    rank = dist.get_rank()
    worker_common.file_barrier(directory, "began-step-3", world=dist.get_world_size(), timeout_s=PAUSE_LIMIT_S,
                               wait=rank == 0)
    if rank == 0:
        open(os.path.join(directory, "release"), "w").close()


def pause_from_environment() -> contextlib.AbstractContextManager:
    """:func:`pause_save_writer` as ``$TWINKLE_TEST_PAUSE_SAVE_WRITER`` asks (nothing where it is unset)."""
    checkpoint, _, directory = os.environ.get(PAUSE_ENV, "").partition(":")
    return pause_save_writer(checkpoint, directory) if checkpoint else contextlib.nullcontext()
