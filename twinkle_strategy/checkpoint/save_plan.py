"""A save as data: the items it writes, declared once per kind of save, carried out by one executor.

Every save of this package is a :class:`SavePlan`: where it goes, how it is published, and a list of
items (frozen dataclasses): :class:`ModelWeights`, :class:`Adapter`, :class:`ModelConfig`, :class:`Tokenizer`,
the trainer state (:class:`~twinkle_strategy.checkpoint.training.TrainerStateFiles`,
:class:`~twinkle_strategy.checkpoint.training.TrainerStateJson`) and a front-end's own files
(:class:`FrontEndFiles`). Which items a full model, a LoRA adapter, the trainer state or a merged export writes
is declared once, as data (:data:`~twinkle_strategy.checkpoint.training.SAVE_KINDS`); the front-ends (twinkle's
``CheckpointManager``, ``NativeFSDPStrategy.save_pretrained`` / ``save_merged``, the ``transformers.Trainer``
mixin: HF Trainer, TRL, ms-swift through it) only say which kinds they save and bring their own content
(:class:`~twinkle_strategy.checkpoint.training.SaveSources`). :func:`execute_save` carries every plan out,
synchronously or asynchronously.

Each item writes through one frozen :class:`SaveContext`, whose few verbs mean the same in both modes:

* ``ctx.open_writer``: rows written now into their files (synchronous), or copied into host buffers now and
  written by a background thread (asynchronous, :mod:`twinkle_strategy.checkpoint.host_copies`);
* ``ctx.on_rank0`` / ``ctx.on_every_rank``: a whole small file written now (its errors raised on every rank),
  or left to the background writer with what it needs taken now;
* ``ctx.at_commit``: what needs every rank's files, run by rank 0 once they are all written, before the
  directory is published (an adapter read back whole from the trainable weights every rank wrote).

So a synchronous and an asynchronous save of the same plan write the same bytes, and an item that fails on
any rank fails the save on every rank with its pending directory removed (nothing half-written under the
final name: :mod:`twinkle_strategy.checkpoint.directories`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from twinkle_strategy.checkpoint.directories import (
    abandon_pending,
    mark_incomplete,
    pending_path,
    prepare_pending,
    publish,
    publish_pending,
    start_pending,
)
from twinkle_strategy.checkpoint.host_copies import HostCopies
from twinkle_strategy.checkpoint.reading import STATE_DIR, IOStats, read_trainable_state
from twinkle_strategy.checkpoint.writing import (
    DEFAULT_MAX_FILE_BYTES,
    OpenWriter,
    ParallelFileWriter,
    save_model_config,
    save_model_files,
)
from twinkle_strategy.distributed.fail_together import FoldedSteps, on_rank0, step_reporter
from twinkle_strategy.distributed.runtime import global_rank, peak_rss_since_reset, reset_peak_rss, rss_bytes
from twinkle_strategy.errors import CheckpointSaveError
from twinkle_strategy.shards.gather import gather_full_state_dict

if TYPE_CHECKING:
    from twinkle_strategy.checkpoint.background import AsyncSaves
    from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan

logger = logging.getLogger(__name__)

CHUNK_BYTES = 32 * 2**20  # rows written (or read) at a time: what a save holds beyond the model's own shards


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------- the context
@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What every item of one save writes with (one per save, the same on every rank but ``stats``' counts)."""

    directory: str  # where the items write: the save's pending directory, or the caller's own (in place)
    model: nn.Module
    ep_plan: ExpertParallelPlan | None
    step_done: Callable[[BaseException | None, str], None]  # the save's fail-together check, after each step
    stats: IOStats
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    chunk_bytes: int = CHUNK_BYTES
    host_copies: HostCopies | None = None  # an asynchronous save: copies now, files written in the background

    @property
    def background(self) -> bool:
        return self.host_copies is not None

    @property
    def open_writer(self) -> OpenWriter:
        return self.host_copies.open_writer if self.host_copies is not None else ParallelFileWriter

    def on_rank0(self, what: str, action: Callable[[], None]) -> None:
        """A whole file written by rank 0: now (an error raised on every rank), or by its background writer."""
        if self.host_copies is None:
            self.step_done(on_rank0(action), what)
        elif global_rank() == 0:
            self.host_copies.defer(f"{what} into {self.directory}", action)

    def on_every_rank(self, what: str, action: Callable[[], None]) -> None:
        """A file every rank writes (its own): now, or by its background writer."""
        if self.host_copies is not None:
            self.host_copies.defer(f"{what} into {self.directory}", action)
            return
        error = None
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = exc
        self.step_done(error, what)

    def at_commit(self, what: str, action: Callable[[], None]) -> None:
        """Rank 0, once every rank has written its files (now, in item order, when synchronous)."""
        if self.host_copies is None:
            self.step_done(on_rank0(action), what)
        elif global_rank() == 0:
            self.host_copies.defer_to_commit(f"{what} into {self.directory}", action)


class SaveItem(Protocol):
    """One part of a save; :meth:`write` is collective (every rank calls it, in the same item order)."""

    def write(self, ctx: SaveContext) -> None: ...


# ------------------------------------------------------------------------------------------------- the items
@dataclasses.dataclass(frozen=True)
class ModelWeights:
    """A full model's weights as a Hugging Face checkpoint, every rank its own rows (no gather); of the tensors
    ``names`` only, if given; into ``subdirectory`` of the save's directory, if given."""

    names: frozenset[str] | None = None
    subdirectory: str = ""

    def write(self, ctx: SaveContext) -> None:
        directory = os.path.join(ctx.directory, self.subdirectory) if self.subdirectory else ctx.directory
        if self.subdirectory and not ctx.background:  # (background writers create directories as they write)
            ctx.step_done(on_rank0(lambda: os.makedirs(directory)), "creating the directory")
        save_model_files(directory, ctx.model, ep_plan=ctx.ep_plan, stats=ctx.stats, step_done=ctx.step_done,
                         max_file_bytes=ctx.max_file_bytes, chunk_bytes=ctx.chunk_bytes, open_writer=ctx.open_writer,
                         names=set(self.names) if self.names is not None else None)


def save_adapter(model: nn.Module, directory: str, state: dict[str, torch.Tensor]) -> None:
    """PEFT's own adapter files, from the whole adapter ``state`` (all experts)."""
    model.save_pretrained(directory, state_dict=state)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A PEFT model's adapter, whole (all experts), in PEFT's format: gathered on rank 0 and written by
    ``write(directory, state)`` (PEFT's ``save_pretrained`` unless a front-end writes more with it).

    ``from_trainable_files`` (asynchronous saves that also write ``trainer_state/``): nothing is gathered while
    training waits; rank 0 reads the adapter back whole at the commit from ``trainer_state/trainable*`` that every
    rank wrote its rows of. Synchronous saves always gather.
    """

    write_files: Callable[[str, dict[str, torch.Tensor]], None] | None = None
    from_trainable_files: bool = False
    what: str = "model weights"

    def write(self, ctx: SaveContext) -> None:
        write = self.write_files or (lambda directory, state: save_adapter(ctx.model, directory, state))
        names = [n for n, p in ctx.model.named_parameters() if p.requires_grad]  # a gathered state dict's order
        if ctx.background and self.from_trainable_files:
            state_dir = os.path.join(ctx.directory, STATE_DIR)
            ctx.at_commit("the adapter", lambda: write(ctx.directory, read_trainable_state(state_dir, names)))
            return
        state = gather_full_state_dict(ctx.model, ctx.ep_plan, rank0_only=True, keys=set(names))
        ctx.stats.bytes_received += sum(t.numel() * t.element_size() for t in state.values())
        ctx.on_rank0(self.what, lambda: write(ctx.directory, state))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``config.json`` and ``generation_config.json`` of a full model (rank 0)."""

    def write(self, ctx: SaveContext) -> None:
        ctx.on_rank0("model config", lambda: save_model_config(ctx.directory, ctx.model))


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """The tokenizer's (or processor's) files (rank 0)."""

    tokenizer: object

    def write(self, ctx: SaveContext) -> None:
        ctx.on_rank0("tokenizer", lambda: self.tokenizer.save_pretrained(ctx.directory))


@dataclasses.dataclass(frozen=True)
class FrontEndFiles:
    """Files a front-end's own code writes into the save's directory (``write(directory)``): transformers'
    ``training_args.bin``, swift's ``_save``, the HF Trainer's RNG state. Whatever ``write`` reads must be
    taken when the item is declared: an asynchronous save runs it later, in its background writer.

    ``every_rank``: each rank writes its own (else rank 0); ``here``: whether this rank writes it at all (the HF
    Trainer's ``should_save``). Every rank declares the item either way: a synchronous save checks each item's
    step on every rank."""

    what: str
    write_files: Callable[[str], None]
    every_rank: bool = False
    here: bool = True

    def write(self, ctx: SaveContext) -> None:
        action = (lambda: self.write_files(ctx.directory)) if self.here else (lambda: None)
        (ctx.on_every_rank if self.every_rank else ctx.on_rank0)(self.what, action)


def write_bytes(directory: str, name: str, data: bytes) -> None:
    """``directory/name`` holding ``data`` (bytes taken when the save was declared), creating ``directory``."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


# ------------------------------------------------------------------------------------------------ the plan
class Publish(str, enum.Enum):
    """How a save's directory gets its final name."""

    REPLACE = "replace"  # a checkpoint: its pending directory renamed over the final name
    MERGE = "merge"  # save_pretrained: into an existing directory with other files, those kept
    IN_PLACE = "in place"  # into the caller's directory, which it finishes itself (the HF Trainer's checkpoint)


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """One save: ``items`` written into ``path`` (through its pending directory unless in place)."""

    path: str
    items: tuple[SaveItem, ...]
    publish: Publish = Publish.REPLACE
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    chunk_bytes: int = CHUNK_BYTES
    after_publish: Callable[[], None] | None = None  # rank 0, once durable: rotation, a front-end's bookkeeping
    subject: str = ""  # how errors name the save (default: "saving <basename>")
    advice: str = "previous checkpoints are untouched"
    report: bool = True  # log the SaveReport's line (rank 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        object.__setattr__(self, "path", os.path.normpath(self.path))


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


# -------------------------------------------------------------------------------------------- the executor
def execute_save(plan: SavePlan, *, model: nn.Module, ep_plan: ExpertParallelPlan | None,
                 background: AsyncSaves | None = None) -> SaveReport:
    """Carry ``plan`` out (collective: every rank calls it); this rank's :class:`SaveReport`.

    Synchronous (``background`` None): the items are written now, each step ending with a fail-together check
    (an error on any rank is raised on every rank and the pending directory removed), then rank 0 publishes.

    Asynchronous (``background``, the run's :class:`~twinkle_strategy.checkpoint.background.AsyncSaves`): it
    waits for the save in flight, rank 0 makes the empty pending directory, every rank copies its share of the
    items into host memory (their errors checked once, together, at the end), and a thread per rank writes them
    while training goes on; rank 0 publishes once every rank's writer is done. The report's ``seconds`` is the
    time training waited.
    """
    in_place = plan.publish == Publish.IN_PLACE
    if in_place and background is not None:
        raise ValueError("an asynchronous save writes through a pending directory; Publish.IN_PLACE is synchronous")
    start = time.perf_counter()
    host_copies = background.begin(plan.path) if background is not None else None
    measure = _SaveMeasure()
    step_done = step_reporter(plan.subject or f"saving {os.path.basename(plan.path)}", error_class=CheckpointSaveError,
                              advice=plan.advice, cleanup=None if in_place else lambda: abandon_pending(plan.path))
    directory = plan.path if in_place else pending_path(plan.path)
    if host_copies is not None:
        step_done = FoldedSteps(step_done, "copying the files")
        step_done(on_rank0(lambda: prepare_pending(plan.path)), "creating the directory")
        if global_rank() == 0:  # the writer's first write: the pending directory is marked incomplete
            host_copies.defer(f"the incomplete marker of {directory}", lambda: mark_incomplete(directory))
    elif not in_place:
        step_done(on_rank0(lambda: start_pending(plan.path)), "creating the directory")
    ctx = SaveContext(directory=directory, model=model, ep_plan=ep_plan, step_done=step_done, stats=measure.stats,
                      max_file_bytes=plan.max_file_bytes, chunk_bytes=plan.chunk_bytes, host_copies=host_copies)
    for item in plan.items:
        item.write(ctx)
    if host_copies is not None:
        step_done.finish()
        background.start(plan.path, commit=lambda: _publish(plan))
    elif not in_place:
        step_done(on_rank0(lambda: _publish(plan)), "finalising")
    report = measure.report(plan.path, model, background=host_copies is not None, log=plan.report)
    report.seconds = time.perf_counter() - start  # asynchronous: the wait for the previous save included
    return report


def _publish(plan: SavePlan) -> None:
    """Rank 0, once every rank has written the plan's items: the pending directory under its final name."""
    if plan.publish == Publish.MERGE:
        publish_pending(plan.path)
    else:
        # The rename is the commit point: before it, resume never sees this checkpoint.
        publish(pending_path(plan.path), plan.path)
    if plan.after_publish is not None:
        plan.after_publish()  # only now: the new save is durable


def save_items(plan_items: Sequence[SaveItem], directory: str, *, model: nn.Module,
               ep_plan: ExpertParallelPlan | None, subject: str) -> None:
    """``plan_items`` written straight into ``directory`` (collective, synchronous): part of a save a caller
    finishes itself (the HF Trainer's own checkpoint directory)."""
    execute_save(SavePlan(directory, tuple(plan_items), publish=Publish.IN_PLACE, subject=subject, advice="",
                          report=False), model=model, ep_plan=ep_plan)


class _SaveMeasure:
    """What a save's :class:`SaveReport` says: its seconds, bytes and peak host memory, from its start."""

    def __init__(self) -> None:
        reset_peak_rss()
        self.rss_before, self.start = rss_bytes(), time.perf_counter()
        self.stats = IOStats()

    def report(self, path: str, model: nn.Module, *, background: bool, log: bool) -> SaveReport:
        shard = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else
                    p.numel() * p.element_size() for p in model.parameters())
        report = SaveReport(path=path, rank=global_rank(), seconds=time.perf_counter() - self.start,
                            bytes_written=self.stats.bytes_written, bytes_received=self.stats.bytes_received,
                            shard_bytes=shard, rss_before_bytes=self.rss_before,
                            peak_rss_bytes=peak_rss_since_reset(), gathered=self.stats.gathered,
                            background=background)
        if log and report.rank == 0:
            logger.info(report.log_line())
        return report
