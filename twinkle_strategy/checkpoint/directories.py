"""The directories a save writes: seen by every rank, pending until complete, then published.

Every rank writes its part of a save into files one rank creates, so the output
directory must be one filesystem that every node mounts at the same path
(:func:`check_shared_directory`, before training: without it another node's
ranks would fail with ``FileNotFoundError`` at the first save, possibly hours
into the run).

A save writes into a sibling *pending directory*, ``<name>.tmp``, which holds an
:data:`INCOMPLETE_MARKER` file from its first moment. When every rank has
written its files, one process fsyncs every file and directory in it, removes
the marker and renames it to its final name (*publishes* it), then fsyncs the
parent so that the rename itself survives a power loss. A process killed at any
point leaves the previous content under the final name and, at most, a pending
directory that every loader of this package refuses (:func:`raise_if_incomplete`).

Why fsync everything: without it a crash shortly after a "finished" save can
leave files of the right size full of zeros (the kernel had not written them
yet), which ``from_pretrained`` loads without a word.

A directory that already holds other files (``save_pretrained`` into a run
directory, as ms-swift's final save does) is not replaced: the new files are
moved into it under the marker, which is removed last, so a kill in between
leaves a directory loaders refuse rather than a mix they would accept.
"""

from __future__ import annotations

import os
import shutil
import uuid

import torch.distributed as dist

from twinkle_strategy.distributed.messages import all_gather_objects, broadcast_object
from twinkle_strategy.errors import CheckpointError, OutputDirNotSharedError

INCOMPLETE_MARKER = ".twinkle-incomplete"
PENDING_SUFFIX = ".tmp"


def pending_path(final: str) -> str:
    """The sibling directory a save of ``final`` writes into before it is complete."""
    return os.path.normpath(final) + PENDING_SUFFIX


def start_pending(final: str) -> str:
    """A fresh, empty pending directory for ``final``, marked incomplete (one process); returns its path."""
    pending = pending_path(final)
    shutil.rmtree(pending, ignore_errors=True)  # left by a save that was killed
    os.makedirs(pending)
    _write_marker(pending)
    return pending


def prepare_pending(final: str) -> str:
    """An empty pending directory for ``final`` (one process), without the marker or any fsync: an asynchronous
    save's writers write the marker (:func:`mark_incomplete`) and everything else in the background. A pending
    directory is never taken for a checkpoint, marker or not: its name ends in :data:`PENDING_SUFFIX`."""
    pending = pending_path(final)
    if os.path.lexists(pending):
        shutil.rmtree(pending, ignore_errors=True)  # left by a save that was killed
    os.makedirs(pending)
    return pending


def mark_incomplete(directory: str) -> None:
    """Write and fsync the :data:`INCOMPLETE_MARKER` of ``directory`` (which must exist)."""
    _write_marker(directory)


def abandon_pending(final: str) -> None:
    """Remove the pending directory of a failed save (renamed first: its removal is not atomic)."""
    pending, trash = pending_path(final), pending_path(final) + ".abandoned"
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.isdir(pending):
        os.rename(pending, trash)
    shutil.rmtree(trash, ignore_errors=True)


def is_incomplete(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, INCOMPLETE_MARKER))


def raise_if_incomplete(directory: str, error_class: type[Exception] = CheckpointError) -> None:
    """Refuse a directory a save has not finished (killed mid-save, or still being written)."""
    if is_incomplete(directory):
        raise error_class(
            f"{directory} is an incomplete save: the process writing it stopped before it finished "
            f"(it still holds {INCOMPLETE_MARKER}). Load the checkpoint it was meant to replace, or save again")


def fsync_path(path: str) -> None:
    """Flush a file's or a directory's contents (a directory: its entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file, then every directory bottom-up, under ``root`` (its own entry included)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def publish_pending(final: str) -> None:
    """Make the finished pending directory of ``final`` durable and give it the final name (one process).

    ``final`` is created by a rename where it does not exist or is empty (:func:`publish`); an existing
    directory with files in it gets the new files moved in, its other files kept (:func:`merge_into`).
    """
    pending = pending_path(final)
    if os.path.isdir(final) and os.listdir(final):
        merge_into(pending, final)
    else:
        publish(pending, final)


def publish(pending: str, final: str) -> None:
    """fsync ``pending``, drop its marker, rename it to ``final`` (replacing it), fsync the parent."""
    _seal(pending)
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(final):
        os.rename(final, old)  # rename() cannot replace a non-empty directory; the old one goes last
    os.rename(pending, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def merge_into(pending: str, final: str) -> None:
    """Move the files of ``pending`` into the existing ``final`` under the incomplete marker, then drop it."""
    _seal(pending)
    _write_marker(final)
    new = set(os.listdir(pending))
    for name in new:
        target = os.path.join(final, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(pending, name), target)
    for name in os.listdir(final):
        if _is_weight_file(name) and name not in new:  # an earlier save's, with another sharding
            os.remove(os.path.join(final, name))
    fsync_path(final)
    os.remove(os.path.join(final, INCOMPLETE_MARKER))
    fsync_path(final)
    shutil.rmtree(pending, ignore_errors=True)


def _is_weight_file(name: str) -> bool:
    return name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))


def _seal(pending: str) -> None:
    fsync_tree(pending)
    os.remove(os.path.join(pending, INCOMPLETE_MARKER))
    fsync_path(pending)


def _write_marker(directory: str) -> None:
    with open(os.path.join(directory, INCOMPLETE_MARKER), "w") as f:
        f.write("a save is writing this directory; it is not complete until this file is gone\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)


# -- every rank sees the output directory (checked before training)
PROBE_DIR = ".twinkle-shared-check"


def check_shared_directory(directory: str, *, what: str = "output_dir") -> None:
    """Raise :class:`OutputDirNotSharedError` on every rank unless every rank sees every rank's files in
    ``directory`` (collective; nothing to check in a one-process job)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    # One name for this check, so files of an earlier run do not count (byte tensors: HCCL has no object collectives).
    name = broadcast_object(uuid.uuid4().hex if rank == 0 else None, src=0)
    probe = os.path.join(directory, PROBE_DIR, name)
    problem = _write_probe(probe, rank)
    dist.barrier()
    missing = [] if problem else [r for r in range(world) if not os.path.exists(os.path.join(probe, f"rank{r}"))]
    verdicts = all_gather_objects((problem, missing))
    dist.barrier()  # everyone has looked: the probe files can go
    if rank == 0:
        shutil.rmtree(os.path.join(directory, PROBE_DIR), ignore_errors=True)
    _raise_for(verdicts, directory, what)


def _write_probe(probe: str, rank: int) -> str | None:
    try:
        os.makedirs(probe, exist_ok=True)
        with open(os.path.join(probe, f"rank{rank}"), "w") as f:
            f.write(str(rank))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _raise_for(verdicts: list, directory: str, what: str) -> None:
    unwritable = {r: problem for r, (problem, _) in enumerate(verdicts) if problem}
    if unwritable:
        first = min(unwritable)
        raise OutputDirNotSharedError(f"{what} {directory} is not writable on rank(s) {sorted(unwritable)} "
                                      f"(rank {first}: {unwritable[first]}); point {what} at a writable directory")
    everyone = set(range(len(verdicts)))
    views: dict[tuple[int, ...], list[int]] = {}  # the ranks a rank sees -> the ranks that see just those
    for rank, (_, missing) in enumerate(verdicts):
        if missing:
            views.setdefault(tuple(sorted(everyone - set(missing))), []).append(rank)
    if views:
        seen = "; ".join(f"rank(s) {ranks} see only the files of rank(s) {list(view)}" for view, ranks in views.items())
        raise OutputDirNotSharedError(
            f"{what} {directory} is not shared by all ranks ({seen}): on another node it is another disk. Every "
            "rank writes its part of each checkpoint there, so several nodes need a shared filesystem (NFS, "
            f"Lustre, a cloud file store) mounted at the same path on every node: set {what} to a directory on it")
