"""Directories that exist under their final name only when complete: staged, fsynced, then renamed.

A save writes into a sibling staging directory, ``<name>.tmp``, which holds an
:data:`INCOMPLETE_MARKER` file from its first moment. When every rank has
written its files, one process fsyncs every file and directory in it, removes
the marker and renames it to its final name, then fsyncs the parent so that
the rename itself survives a power loss. A process killed at any point leaves
the previous content under the final name and, at most, a staging directory
that every loader of this package refuses (:func:`raise_if_incomplete`).

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

from twinkle_strategy.errors import CheckpointError

INCOMPLETE_MARKER = ".twinkle-incomplete"
STAGING_SUFFIX = ".tmp"


def staging_path(final: str) -> str:
    """The sibling directory a save of ``final`` writes into before it is complete."""
    return os.path.normpath(final) + STAGING_SUFFIX


def start_staging(final: str) -> str:
    """A fresh, empty staging directory for ``final``, marked incomplete (one process); returns its path."""
    staging = staging_path(final)
    shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    os.makedirs(staging)
    _write_marker(staging)
    return staging


def prepare_staging(final: str) -> str:
    """An empty staging directory for ``final`` (one process), without the marker or any fsync: an asynchronous
    save's writers write the marker (:func:`mark_incomplete`) and everything else in the background. A staging
    directory is never taken for a checkpoint, marker or not: its name ends in :data:`STAGING_SUFFIX`."""
    staging = staging_path(final)
    if os.path.lexists(staging):
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    os.makedirs(staging)
    return staging


def mark_incomplete(directory: str) -> None:
    """Write and fsync the :data:`INCOMPLETE_MARKER` of ``directory`` (which must exist)."""
    _write_marker(directory)


def abandon_staging(final: str) -> None:
    """Remove the staging directory of a failed save (renamed first: its removal is not atomic)."""
    staging, trash = staging_path(final), staging_path(final) + ".abandoned"
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.isdir(staging):
        os.rename(staging, trash)
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


def commit_staging(final: str) -> None:
    """Make the finished staging directory of ``final`` durable and give it the final name (one process).

    ``final`` is created by a rename where it does not exist or is empty (:func:`publish`); an existing
    directory with files in it gets the new files moved in, its other files kept (:func:`merge_into`).
    """
    staging = staging_path(final)
    if os.path.isdir(final) and os.listdir(final):
        merge_into(staging, final)
    else:
        publish(staging, final)


def publish(staging: str, final: str) -> None:
    """fsync ``staging``, drop its marker, rename it to ``final`` (replacing it), fsync the parent."""
    _seal(staging)
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(final):
        os.rename(final, old)  # rename() cannot replace a non-empty directory; the old one goes last
    os.rename(staging, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def merge_into(staging: str, final: str) -> None:
    """Move the files of ``staging`` into the existing ``final`` under the incomplete marker, then drop it."""
    _seal(staging)
    _write_marker(final)
    new = set(os.listdir(staging))
    for name in new:
        target = os.path.join(final, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)
    for name in os.listdir(final):
        if _is_weight_file(name) and name not in new:  # an earlier save's, with another sharding
            os.remove(os.path.join(final, name))
    fsync_path(final)
    os.remove(os.path.join(final, INCOMPLETE_MARKER))
    fsync_path(final)
    shutil.rmtree(staging, ignore_errors=True)


def _is_weight_file(name: str) -> bool:
    return name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))


def _seal(staging: str) -> None:
    fsync_tree(staging)
    os.remove(os.path.join(staging, INCOMPLETE_MARKER))
    fsync_path(staging)


def _write_marker(directory: str) -> None:
    with open(os.path.join(directory, INCOMPLETE_MARKER), "w") as f:
        f.write("a save is writing this directory; it is not complete until this file is gone\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)
