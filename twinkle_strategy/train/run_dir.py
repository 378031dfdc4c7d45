"""The run directory: ``output_dir/v{N}-{YYYYMMDD-HHMMSS}`` (like swift), its ``args.json`` and ``logging.jsonl``
(written through :mod:`twinkle_strategy.step.run_files`, as every front-end writes it).

A new run gets the next version. A worker that torchrun restarted (``launch.max_restarts``)
sees ``TORCHELASTIC_RESTART_COUNT`` > 0 and continues the newest run directory instead,
so its checkpoints and log stay in one place. Checkpoints inside it belong to
:class:`twinkle_strategy.checkpoint.manager.CheckpointManager`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from twinkle_strategy.distributed.messages import broadcast_object

if TYPE_CHECKING:
    from twinkle_strategy.strategy import NativeFSDPStrategy
    from twinkle_strategy.train.arguments import TrainingArguments

ARGS_FILE = "args.json"
_VERSION = re.compile(r"v(\d+)-")


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: str
    restarted: bool  # torchrun restarted this worker group: the run continues from its newest checkpoint


def make_run_dir(output_dir: str, add_version: bool) -> str:
    """``output_dir/v{N}-{timestamp}`` with N one more than the highest existing version (not created)."""
    if not add_version:
        return output_dir
    versions = [version for version, _ in _versions(output_dir)]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(output_dir, f"v{max(versions, default=-1) + 1}-{stamp}")


def newest_run_dir(output_dir: str) -> str | None:
    """The ``v{N}-...`` run directory with the highest N in ``output_dir`` (the one a restart continues)."""
    runs = _versions(output_dir)
    return os.path.join(output_dir, max(runs)[1]) if runs else None


def _versions(output_dir: str) -> list[tuple[int, str]]:
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return [(int(m.group(1)), name) for name in names if (m := _VERSION.match(name))]


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 for a first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def open_run_dir(args: TrainingArguments, strategy: NativeFSDPStrategy, run_dir: str | None = None) -> RunDir:
    """The run directory every rank of this run uses, created, with ``args.json`` written (collective).

    ``run_dir``: the one a launcher chose; otherwise a new version under ``args.output_dir``, or after
    a torchrun restart the newest one there.
    """
    # torchrun counts restarts per node, and only on the node whose workers failed: ask every rank.
    flag = torch.tensor(float(restart_count() > 0), device=strategy.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    restarted = bool(flag > 0)
    if restarted and run_dir is None and args.add_version:
        run_dir = newest_run_dir(args.output_dir)  # a restarted worker continues its run, not a new one
    # Rank 0's choice for everyone: with several real nodes, each node's launcher may have named its own.
    run_dir = (run_dir or make_run_dir(args.output_dir, args.add_version)) if strategy.is_main_process else None
    if dist.is_initialized():
        run_dir = broadcast_object(run_dir, src=0)  # byte tensors on the backend's device: HCCL has no object collectives
    if strategy.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        _write_args(run_dir, args, strategy)
    return RunDir(run_dir, restarted)


def _write_args(run_dir: str, args: TrainingArguments, strategy: NativeFSDPStrategy) -> None:
    with open(os.path.join(run_dir, ARGS_FILE), "w") as f:
        json.dump({"training_args": dataclasses.asdict(args), "world_size": strategy.world_size,
                   "ep_size": strategy.ep_size, "memory_efficient_init": strategy.memory_efficient_init}, f, indent=2)
