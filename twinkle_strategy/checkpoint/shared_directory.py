"""Checking, before training, that every rank sees the same output directory.

Saves are written by every rank into files one rank creates (no rank gathers
the model), so with several nodes the output directory must be one filesystem
that every node mounts at the same path. Without this check, another node's
ranks would fail with ``FileNotFoundError`` at the first save, possibly hours
into the run. Each rank writes a small file, all wait for each other, and each
looks for everyone's files: the verdict is gathered, so every rank raises the
same error naming the ranks that could not see each other.
"""

from __future__ import annotations

import os
import shutil
import uuid

import torch.distributed as dist

from twinkle_strategy.distributed.messages import all_gather_objects, broadcast_object
from twinkle_strategy.errors import OutputDirNotSharedError

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
