"""``checkpoint-{step}/``: what users load, and what resume needs on any layout of nodes, ranks and ep_size.

Layout (like ms-swift / transformers):

* Full runs: the model as a Hugging Face checkpoint (``model*.safetensors``,
  ``model.safetensors.index.json``, ``config.json``) in the key layout of the
  checkpoint the run started from; plain ``from_pretrained`` loads it. Every
  rank writes its own rows into the files (no gather: see
  :mod:`twinkle_strategy.checkpoint.model_files`).
* LoRA runs: ``adapter_model.safetensors`` + ``adapter_config.json`` with the
  full adapter (all experts), loadable by plain PEFT on one process.
* ``trainer_state/``: optimizer state by full tensor (``optimizer*.safetensors``,
  ``optimizer.json``), the trainable weights of adapter runs
  (``trainable*.safetensors``), ``scheduler.pt`` and each rank's RNG state
  (``rng/rank{R}.pt``): everything resume needs, readable by any layout.
* ``trainer_state.json``, written last.

Every checkpoint is written to ``checkpoint-{step}.tmp``, fsynced and renamed
once all ranks have finished (:mod:`twinkle_strategy.checkpoint.directories`), so a
crash mid-save never leaves a directory that resume would take for a checkpoint;
older checkpoints are rotated away only after that rename is durable.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.checkpoint.directories import (
    abandon_pending,
    fsync_path,
    mark_incomplete,
    pending_path,
    prepare_pending,
    publish,
    raise_if_incomplete,
    start_pending,
)
from twinkle_strategy.checkpoint.files import SafetensorsIndex
from twinkle_strategy.checkpoint.host_copies import HostCopies
from twinkle_strategy.checkpoint.model_files import (
    DEFAULT_MAX_FILE_BYTES,
    read_model_files,
    save_model_config,
    save_model_files,
)
from twinkle_strategy.checkpoint.optimizer_files import (
    TRAINABLE_PREFIX,
    OptimizerFiles,
    TrainableFiles,
    read_optimizer_files,
    read_trainable_files,
)
from twinkle_strategy.checkpoint.sharded_io import IOStats, regions_of
from twinkle_strategy.checkpoint.writer import ParallelFileWriter
from twinkle_strategy.distributed.fail_together import FoldedSteps, on_rank0, step_reporter
from twinkle_strategy.distributed.runtime import global_rank, peak_rss_since_reset, reset_peak_rss, rss_bytes
from twinkle_strategy.errors import CheckpointSaveError, ResumeError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
STATE_DIR = "trainer_state"
CHUNK_BYTES = 32 * 2**20  # rows written (or read) at a time: what a save holds beyond the model's own shards


class CheckpointedStrategy(Protocol):
    """What saving and resuming ask of the strategy (:class:`~twinkle_strategy.NativeFSDPStrategy` is one)."""

    ep_plan: ExpertParallelPlan | None
    is_main_process: bool

    def full_state_dict(self, model: nn.Module, rank0_only: bool = False, keys: set[str] | None = None
                        ) -> dict[str, torch.Tensor]: ...


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@dataclasses.dataclass
class SaveReport:
    """What one rank did while saving a checkpoint."""

    path: str
    rank: int
    seconds: float
    bytes_written: int  # into the checkpoint's files, by this rank
    bytes_received: int  # tensor bytes gathered from other ranks (adapters; tensors not laid out in rows)
    shard_bytes: int  # parameter bytes this rank keeps
    rss_before_bytes: int
    peak_rss_bytes: int  # during the save
    gathered: list[str] = dataclasses.field(default_factory=list)
    background: bool = False  # asynchronous: ``seconds`` is the time training waited; the rows are still being written

    def log_line(self) -> str:
        mib = 2**20
        done = "staged" if self.background else "saved"
        wrote = "staged for its background writer" if self.background else "wrote"
        # What it wrote (trained weights, optimizer state) is not a part of the model shard it keeps: two figures.
        return (f"{done} {self.path} in {self.seconds:.2f}s: rank {self.rank} {wrote} {self.bytes_written / mib:.1f} MiB "
                f"(weights, and optimizer state when saved; it keeps a {self.shard_bytes / mib:.1f} MiB model shard), "
                f"received {self.bytes_received / mib:.1f} MiB, "
                f"peak host RSS {self.peak_rss_bytes / mib:.0f} MiB "
                f"(+{(self.peak_rss_bytes - self.rss_before_bytes) / mib:.0f} MiB during the save)")


def save_checkpoint(path: str, model: nn.Module, strategy: CheckpointedStrategy, *, optimizer, scheduler,
                    trainer_state: dict, tokenizer=None, save_optimizer: bool = True,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, chunk_bytes: int = CHUNK_BYTES) -> SaveReport:
    """Write ``path`` atomically (collective: every rank calls it); returns this rank's :class:`SaveReport`.

    Each step ends with a fail-together check instead of a plain barrier: if
    any rank cannot write (disk full, permissions), every rank raises the same
    error and the half-written ``.tmp`` directory is removed. A process killed
    mid-save leaves only ``.tmp``, which resume ignores.

    An asynchronous save stages instead: :func:`stage_checkpoint`, then :func:`commit_checkpoint` on rank 0
    (:mod:`twinkle_strategy.checkpoint.background`).
    """
    tmp = pending_path(path)
    measure = _SaveMeasure()
    step_done = step_reporter(f"saving {os.path.basename(path)}", error_class=CheckpointSaveError,
                              advice="previous checkpoints are untouched",
                              cleanup=lambda: abandon_pending(path))

    step_done(on_rank0(lambda: start_pending(path)), "creating the directory")
    peft = is_peft_model(model)
    if peft:
        # The adapter is small: gathered on rank 0 and saved by PEFT, as plain PEFT loads it (all experts).
        state = strategy.full_state_dict(model, rank0_only=True, keys=trainable_names(model))
        measure.stats.bytes_received += sum(t.numel() * t.element_size() for t in state.values())
        step_done(on_rank0(lambda: model.save_pretrained(tmp, state_dict=state)), "model weights")
        del state
    else:
        save_model_files(tmp, model, ep_plan=strategy.ep_plan, stats=measure.stats, step_done=step_done,
                         max_file_bytes=max_file_bytes, chunk_bytes=chunk_bytes)

    def small_files():
        if not peft:
            save_model_config(tmp, model)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    step_done(on_rank0(small_files), "model config")
    save_trainer_state(tmp, model, strategy.ep_plan, optimizer=optimizer if save_optimizer else None,
                       scheduler=scheduler, step_done=step_done, stats=measure.stats, max_file_bytes=max_file_bytes,
                       chunk_bytes=chunk_bytes)
    step_done(on_rank0(lambda: commit_checkpoint(path, trainer_state)), "finalising")
    return measure.report(path, model, background=False)


def stage_checkpoint(path: str, model: nn.Module, strategy: CheckpointedStrategy, *, optimizer, scheduler,
                     staging: HostCopies, tokenizer=None, save_optimizer: bool = True,
                     max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, chunk_bytes: int = CHUNK_BYTES) -> SaveReport:
    """An asynchronous save's part at the save step (collective): ``path``'s files as :func:`save_checkpoint`
    writes them, staged in host memory or deferred to the background writers; the report's ``seconds`` is the
    time this took.

    Rank 0 creates the empty pending directory; nothing else touches the disk. The steps' errors are checked
    once, together, at the end (:class:`FoldedSteps`): the steps write nothing a later step reads. An adapter is
    written by rank 0 at the commit, read back whole from the trainable weights every rank wrote its rows of
    (:func:`stage_weights`): no gather while training waits.
    """
    tmp = pending_path(path)
    measure = _SaveMeasure()
    steps = begin_staged_directory(path, staging)
    stage_weights(tmp, model, strategy, staging=staging, step_done=steps, stats=measure.stats,
                  max_file_bytes=max_file_bytes, chunk_bytes=chunk_bytes,
                  write_adapter=lambda state: model.save_pretrained(tmp, state_dict=state))
    if tokenizer is not None and global_rank() == 0:
        staging.defer(f"the tokenizer into {tmp}", lambda: tokenizer.save_pretrained(tmp))
    save_trainer_state(tmp, model, strategy.ep_plan, optimizer=optimizer if save_optimizer else None,
                       scheduler=scheduler, step_done=steps, stats=measure.stats, max_file_bytes=max_file_bytes,
                       chunk_bytes=chunk_bytes, staging=staging)
    steps.finish()
    return measure.report(path, model, background=True)


def begin_staged_directory(path: str, staging: HostCopies) -> FoldedSteps:
    """An asynchronous save's start (collective): rank 0 makes the empty pending directory of ``path`` and leaves
    its incomplete marker to its writer (its first write); returns the steps' folded fail-together check, whose
    :meth:`~FoldedSteps.finish` every rank calls once everything is staged."""
    steps = FoldedSteps(step_reporter(f"saving {os.path.basename(path)}", error_class=CheckpointSaveError,
                                      advice="previous checkpoints are untouched",
                                      cleanup=lambda: abandon_pending(path)),
                        "staging the files")
    steps(on_rank0(lambda: prepare_pending(path)), "creating the directory")
    if global_rank() == 0:
        tmp = pending_path(path)
        staging.defer(f"the incomplete marker of {tmp}", lambda: mark_incomplete(tmp))
    return steps


def stage_weights(directory: str, model: nn.Module, strategy: CheckpointedStrategy, *, staging: HostCopies,
                  step_done, stats: IOStats, max_file_bytes: int, chunk_bytes: int,
                  write_adapter: Callable[[dict[str, torch.Tensor]], None] | None,
                  adapter_from_trainable_files: bool = True) -> None:
    """An asynchronous save of the model's weights into ``directory`` (collective), as a synchronous save writes
    them: a full model's rows staged and its config deferred (rank 0); a PEFT model's adapter, whole, given to
    ``write_adapter`` on rank 0 (e.g. PEFT's ``save_pretrained(directory, state_dict=...)``; unused for a full model).

    ``adapter_from_trainable_files``: the save also writes ``trainer_state/trainable*.safetensors`` (every rank its
    rows, :func:`save_trainer_state`), so rank 0 reads the adapter back from those at the commit, once every rank
    has written them; otherwise it is gathered on rank 0 now and written by its background writer.
    """
    if not is_peft_model(model):
        save_model_files(directory, model, ep_plan=strategy.ep_plan, stats=stats, step_done=step_done,
                         max_file_bytes=max_file_bytes, chunk_bytes=chunk_bytes, open_writer=staging.open_writer)
        if global_rank() == 0:
            staging.defer(f"the model config into {directory}", lambda: save_model_config(directory, model))
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # in the order a gathered state dict has
    if adapter_from_trainable_files:
        if global_rank() == 0:
            state_dir = os.path.join(directory, STATE_DIR)
            staging.defer_to_commit(f"the adapter into {directory}",
                                    lambda: write_adapter(read_trainable_state(state_dir, names)))
        return
    state = strategy.full_state_dict(model, rank0_only=True, keys=set(names))
    stats.bytes_received += sum(t.numel() * t.element_size() for t in state.values())
    if global_rank() == 0:
        staging.defer(f"the adapter into {directory}", lambda: write_adapter(state))


def read_trainable_state(state_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The trainable weights saved in ``state_dir`` (``trainer_state/``), whole, in the order of ``names``."""
    files = sorted(os.path.join(state_dir, f) for f in os.listdir(state_dir)
                   if f.startswith(TRAINABLE_PREFIX) and f.endswith(".safetensors"))
    index = SafetensorsIndex(files)
    try:
        return {name: index.read(name, None) for name in names}
    finally:
        index.close()


class _SaveMeasure:
    """What a save's :class:`SaveReport` says: its seconds, bytes and peak host memory, from its start."""

    def __init__(self) -> None:
        reset_peak_rss()
        self.rss_before, self.start = rss_bytes(), time.perf_counter()
        self.stats = IOStats()

    def report(self, path: str, model: nn.Module, *, background: bool) -> SaveReport:
        shard = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else
                    p.numel() * p.element_size() for p in model.parameters())
        report = SaveReport(path=path, rank=global_rank(), seconds=time.perf_counter() - self.start,
                            bytes_written=self.stats.bytes_written, bytes_received=self.stats.bytes_received,
                            shard_bytes=shard, rss_before_bytes=self.rss_before,
                            peak_rss_bytes=peak_rss_since_reset(), gathered=self.stats.gathered,
                            background=background)
        if report.rank == 0:
            logger.info(report.log_line())
        return report


def commit_checkpoint(path: str, trainer_state: dict) -> None:
    """Write ``trainer_state.json`` into the finished pending directory of ``path``, make it durable and give it
    its final name (one process, once every rank has written its files)."""
    with open(os.path.join(pending_path(path), STATE_FILE), "w") as f:
        json.dump(trainer_state, f, indent=2)
    # The rename is the commit point: before it, resume never sees this checkpoint.
    publish(pending_path(path), path)


def load_checkpoint(path: str, model: nn.Module, strategy: CheckpointedStrategy, *, optimizer, scheduler,
                    expect: dict, stats: IOStats | None = None) -> dict:
    """Restore ``model``'s shards, the optimizer, scheduler and RNG from ``path``; return the trainer state.

    Works for any layout of nodes, ranks and ep_size: each rank reads the rows of its own shards.
    ``expect`` lists what must match (e.g. the global batch, so each step sees the same samples).
    ``stats`` (if given) counts the tensor bytes this rank read.
    """
    raise_if_incomplete(path, ResumeError)
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise ResumeError(f"{path} is not a complete checkpoint (no {STATE_FILE}); pick another checkpoint-* "
                          "directory")
    with open(state_path) as f:
        trainer_state = json.load(f)
    state_dir = os.path.join(path, STATE_DIR)
    if not os.path.isfile(os.path.join(state_dir, "optimizer.json")) and optimizer is not None:
        raise ResumeError(f"{path} has no optimizer state ({STATE_DIR}/optimizer.json): it was saved with "
                          "save_only_model, or by an older version; start a new run from its weights instead")
    for key, value in expect.items():
        if trainer_state.get(key) != value:
            raise ResumeError(f"checkpoint {path} was saved with {key}={trainer_state.get(key)}, this run has "
                              f"{key}={value}. {_EXPECT_HINTS.get(key, '')}".strip())
    load_trained_weights(path, model, strategy.ep_plan, stats=stats)
    load_trainer_state(path, model, strategy.ep_plan, optimizer=optimizer, scheduler=scheduler, stats=stats)
    return trainer_state


def save_trainer_state(directory: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, *, optimizer, scheduler,
                       step_done, stats: IOStats | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                       chunk_bytes: int = CHUNK_BYTES, staging: HostCopies | None = None) -> None:
    """``directory/trainer_state/``: what resume needs beyond the saved model, readable by any layout (collective).

    The optimizer state by full tensor, an adapter run's trainable weights, the scheduler and each rank's RNG.
    ``step_done`` is a :func:`~twinkle_strategy.distributed.fail_together.step_reporter`: an error on any rank
    is raised on every rank. With ``staging`` (an asynchronous save) the files are created now, and their rows,
    the scheduler and the RNG state are copied now and written later by the background writer.
    """
    stats = stats if stats is not None else IOStats()
    state_dir = os.path.join(directory, STATE_DIR)
    open_writer = staging.open_writer if staging is not None else ParallelFileWriter
    parts = _trainer_state_parts(model, ep_plan, optimizer, max_file_bytes,
                                 cache=staging.plans if staging is not None else None)
    # Taken now, written now or (asynchronous) by the background writer: training changes them from the next step.
    scheduler_state = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    rng_state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                 "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    rng_file = os.path.join(state_dir, "rng", f"rank{global_rank()}.pt")

    def create():  # asynchronous: the headers and small files are staged, the directories made by the writers
        if staging is None:
            os.makedirs(os.path.join(state_dir, "rng"), exist_ok=True)
        for part in parts:
            part.create(state_dir, open_writer)

    def write_scheduler():
        os.makedirs(state_dir, exist_ok=True)
        torch.save(scheduler_state, os.path.join(state_dir, "scheduler.pt"))

    def write_rng():
        os.makedirs(os.path.dirname(rng_file), exist_ok=True)
        torch.save(rng_state, rng_file)
        fsync_path(rng_file)  # by its writer: on a shared filesystem another node's fsync may not cover it

    step_done(on_rank0(create), "trainer state")
    error = None
    for part in parts:
        error = part.write(state_dir, chunk_bytes=chunk_bytes, stats=stats, open_writer=open_writer) or error
    if staging is not None:
        if scheduler_state is not None and global_rank() == 0:
            staging.defer(f"scheduler.pt into {state_dir}", write_scheduler)
        staging.defer(rng_file, write_rng)
    else:
        if scheduler_state is not None:
            error = error or on_rank0(write_scheduler)
        try:
            write_rng()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = error or exc
    step_done(error, "trainer state")


def _trainer_state_parts(model: nn.Module, ep_plan: ExpertParallelPlan | None, optimizer, max_file_bytes: int, *,
                         cache: dict | None) -> list:
    """The files of ``trainer_state/`` (an adapter run's trainable weights, the optimizer state), planned; from
    ``cache`` when an earlier save of the same parameters, optimizer state keys and file size planned them."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or (optimizer is not None and
                                                                                  p in optimizer.state)]
    key = ("trainer_state", id(model), id(optimizer), id(ep_plan), max_file_bytes,
           tuple((n, id(p), tuple(optimizer.state[p]) if optimizer is not None and p in optimizer.state else ())
                 for n, p in params))
    if cache is not None and key in cache:
        return cache[key]
    # Walked once for both parts: an adapter run's optimizer holds state for its trainable weights only.
    regions = regions_of(model, ep_plan, names={n for n, _ in params})
    parts = [TrainableFiles(model, ep_plan, max_file_bytes, regions=regions)] if is_peft_model(model) else []
    if optimizer is not None:
        parts.append(OptimizerFiles(model, optimizer, ep_plan, max_file_bytes, regions=regions))
    if cache is not None:
        cache.clear()  # one model's plans at a time
        cache[key] = parts
    return parts


def load_trained_weights(path: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, *,
                         stats: IOStats | None = None) -> None:
    """Each rank reads its own rows of the trained weights of ``path`` (an adapter run's trainable weights
    from ``trainer_state/``, else the saved model), whatever layout saved them."""
    stats = stats if stats is not None else IOStats()
    if is_peft_model(model):
        read_trainable_files(os.path.join(path, STATE_DIR), model, ep_plan, stats)
    else:
        read_model_files(path, model, ep_plan, stats)


def load_trainer_state(path: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, *, optimizer,
                       scheduler, stats: IOStats | None = None) -> None:
    """Optimizer (each rank its own rows), scheduler and, on the same world size, RNG state from
    ``path/trainer_state/``."""
    state_dir = os.path.join(path, STATE_DIR)
    if optimizer is not None:
        read_optimizer_files(state_dir, model, optimizer, ep_plan, stats if stats is not None else IOStats())
    if scheduler is not None and os.path.isfile(os.path.join(state_dir, "scheduler.pt")):
        scheduler.load_state_dict(torch.load(os.path.join(state_dir, "scheduler.pt"), weights_only=False))
    rng_file = os.path.join(state_dir, "rng", f"rank{global_rank()}.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if os.path.isfile(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        if rng.get("world_size") == world:  # on another layout, rank R's random stream is not rank R's any more
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])


_EXPECT_HINTS = {
    "global_batch": ("The samples of each step depend on the global batch (per_device_train_batch_size x "
                     "gradient_accumulation_steps x data-parallel ranks): keep it, e.g. double "
                     "per_device_train_batch_size on half the ranks."),
    "peft": "Resume a LoRA run with the same LoRA configuration, and a full run without one.",
}
