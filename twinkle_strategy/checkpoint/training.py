"""What each kind of save writes, declared once; and ``checkpoint-{step}/``, what resume reads on any layout.

**Saves by kind.** :data:`SAVE_KINDS` is the one list of what a save writes, as data: for each
:class:`SaveKind` (a full model, a LoRA adapter, the trainer state, a merged export) its :class:`Part` s in the
order they are written. :func:`declare` turns kinds and what a front-end brings (:class:`SaveSources`: its
tokenizer, its own files, the optimizer...) into save items, the one place items are listed; the executor
(:mod:`twinkle_strategy.checkpoint.save_plan`) carries them out, synchronously or in the background. Every
front-end saves through it: twinkle's Trainer (:func:`checkpoint_items`), ``strategy.save_pretrained``
(:func:`save_pretrained`) and ``save_merged``, and the ``transformers.Trainer`` mixin (HF Trainer, TRL, ms-swift)
in both its synchronous and asynchronous saves.

**A training checkpoint** (like ms-swift / transformers):

* Full runs: the model as a Hugging Face checkpoint (``model*.safetensors``,
  ``model.safetensors.index.json``, ``config.json``) in the key layout of the
  checkpoint the run started from; plain ``from_pretrained`` loads it. Every
  rank writes its own rows into the files (no gather: see
  :mod:`twinkle_strategy.checkpoint.writing`).
* LoRA runs: ``adapter_model.safetensors`` + ``adapter_config.json`` with the
  full adapter (all experts), loadable by plain PEFT on one process.
* ``trainer_state/``: optimizer state by full tensor (``optimizer*.safetensors``,
  ``optimizer.json``), the trainable weights of adapter runs
  (``trainable*.safetensors``), ``scheduler.pt`` and each rank's RNG state
  (``rng/rank{R}.pt``): everything resume needs, readable by any layout.
* ``trainer_state.json``, written last.

Every checkpoint is written to its pending directory ``checkpoint-{step}.tmp``, fsynced and renamed once all
ranks have finished (:mod:`twinkle_strategy.checkpoint.directories`), so a crash mid-save never leaves a
directory that resume would take for a checkpoint; older checkpoints are rotated away only after that rename is
durable.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import os
import random
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.checkpoint.directories import check_shared_directory, fsync_path, raise_if_incomplete
from twinkle_strategy.checkpoint.reading import (
    STATE_DIR,
    IOStats,
    read_model_files,
    read_optimizer_files,
    read_trainable_files,
)
from twinkle_strategy.checkpoint.save_plan import (
    CHUNK_BYTES,
    Adapter,
    FrontEndFiles,
    ModelConfig,
    ModelWeights,
    Publish,
    SaveContext,
    SaveItem,
    SavePlan,
    SaveReport,
    Tokenizer,
    execute_save,
    is_peft_model,
    write_bytes,
)
from twinkle_strategy.checkpoint.writing import DEFAULT_MAX_FILE_BYTES, OptimizerFiles, TrainableFiles
from twinkle_strategy.distributed.fail_together import on_rank0
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.errors import ResumeError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import regions_of

STATE_FILE = "trainer_state.json"


class CheckpointedStrategy(Protocol):
    """What saving and resuming ask of the strategy (:class:`~twinkle_strategy.NativeFSDPStrategy` is one)."""

    ep_plan: ExpertParallelPlan | None
    is_main_process: bool


@dataclasses.dataclass(frozen=True)
class TrainerStateFiles:
    """``trainer_state/``: what resume needs beyond the saved model, readable by any layout.

    The optimizer state by full tensor (none without ``optimizer``), an adapter run's trainable weights, the
    scheduler and each rank's RNG. The scheduler's and RNG state are taken when the item is written (an
    asynchronous save's background writer writes them later: training changes them from the next step).
    """

    optimizer: object = None
    scheduler: object = None

    def write(self, ctx: SaveContext) -> None:
        state_dir = os.path.join(ctx.directory, STATE_DIR)
        parts = _trainer_state_parts(ctx.model, ctx.ep_plan, self.optimizer, ctx.max_file_bytes,
                                     cache=ctx.host_copies.plans if ctx.background else None)
        scheduler_state = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None
        rng_state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                     "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        rng_file = os.path.join(state_dir, "rng", f"rank{global_rank()}.pt")

        def create():  # asynchronous: the headers and small files are copied, the directories made by the writers
            if not ctx.background:
                os.makedirs(os.path.join(state_dir, "rng"), exist_ok=True)
            for part in parts:
                part.create(state_dir, ctx.open_writer)

        def write_scheduler():
            os.makedirs(state_dir, exist_ok=True)
            torch.save(scheduler_state, os.path.join(state_dir, "scheduler.pt"))

        def write_rng():
            os.makedirs(os.path.dirname(rng_file), exist_ok=True)
            torch.save(rng_state, rng_file)
            fsync_path(rng_file)  # by its writer: on a shared filesystem another node's fsync may not cover it

        ctx.step_done(on_rank0(create), "trainer state")
        error = None
        for part in parts:
            error = part.write(state_dir, chunk_bytes=ctx.chunk_bytes, stats=ctx.stats,
                               open_writer=ctx.open_writer) or error
        if ctx.background:
            if scheduler_state is not None and global_rank() == 0:
                ctx.host_copies.defer(f"scheduler.pt into {state_dir}", write_scheduler)
            ctx.host_copies.defer(rng_file, write_rng)
            return
        if scheduler_state is not None:
            error = error or on_rank0(write_scheduler)
        try:
            write_rng()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = error or exc
        ctx.step_done(error, "trainer state")


@dataclasses.dataclass(frozen=True)
class TrainerStateJson:
    """``trainer_state.json``, written last (rank 0, at the commit): a checkpoint counts once it exists.
    ``content``: a dict (written as JSON) or the bytes a front-end's own code wrote (the HF Trainer's)."""

    content: dict | bytes

    def write(self, ctx: SaveContext) -> None:
        text = self.content if isinstance(self.content, bytes) else json.dumps(self.content, indent=2).encode()
        ctx.at_commit(STATE_FILE, lambda: write_bytes(ctx.directory, STATE_FILE, text))


# --------------------------------------------------------------------------------------- the kinds of save
class SaveKind(enum.Enum):
    """What a save is of. A training checkpoint is two kinds: the model's (full or adapter) and the trainer state."""

    FULL_MODEL = "full model"  # the model as a Hugging Face checkpoint
    LORA_ADAPTER = "LoRA adapter"  # a PEFT model's adapter, whole (all experts), in PEFT's format
    TRAINER_STATE = "trainer state"  # what resume needs beyond the weights
    MERGED_EXPORT = "merged export"  # a LoRA run's adapters merged into its base, in the model's dtype
    MERGED_RELEASE_EXPORT = "merged export in the release's format"  # the merged weights; the rest the release's


class Part(enum.Enum):
    """One item of a save, by what it writes. Optional parts are written when the front-end brings them."""

    MODEL_WEIGHTS = "model*.safetensors and its index, every rank its own rows"
    MODEL_CONFIG = "config.json and generation_config.json"
    ADAPTER = "the adapter (PEFT's files, or the front-end's adapter writer), gathered or read back at the commit"
    TOKENIZER = "the tokenizer's (or processor's) files, when the front-end has one"
    FRONT_END_FILES = "the front-end's own files (training_args.bin, swift's _save), when it brings them"
    TRAINER_STATE_FILES = "trainer_state/: optimizer, trainable weights, scheduler, RNG (unless saving the model only)"
    FRONT_END_STATE_FILES = "the front-end's own state files (the HF Trainer's rng_state_<i>.pth), when it brings them"
    TRAINER_STATE_JSON = "trainer_state.json, at the commit, when the front-end brings its content"
    MERGED_WEIGHTS = "the merged weights only, into the subdirectory the release's files are assembled around"
    RELEASE_FILES = "the release's own files around the merged weights (the merged export brings them)"


SAVE_KINDS = MappingProxyType({
    SaveKind.FULL_MODEL: (Part.MODEL_WEIGHTS, Part.MODEL_CONFIG, Part.TOKENIZER, Part.FRONT_END_FILES),
    SaveKind.LORA_ADAPTER: (Part.ADAPTER, Part.TOKENIZER, Part.FRONT_END_FILES),
    SaveKind.TRAINER_STATE: (Part.TRAINER_STATE_FILES, Part.FRONT_END_STATE_FILES, Part.TRAINER_STATE_JSON),
    SaveKind.MERGED_EXPORT: (Part.MODEL_WEIGHTS, Part.MODEL_CONFIG),
    SaveKind.MERGED_RELEASE_EXPORT: (Part.MERGED_WEIGHTS, Part.RELEASE_FILES),
})


@dataclasses.dataclass(frozen=True)
class SaveSources:
    """What a front-end brings to a save beside the model; an optional part it leaves out is not written.
    Whatever a front-end's own files read must be taken now: an asynchronous save writes them later."""

    tokenizer: object = None
    front_end_files: FrontEndFiles | None = None
    # The adapter: PEFT's save_pretrained unless the front-end writes more with it (swift's files after PEFT's).
    adapter_writer: Callable[[str, dict], None] | None = None
    # Asynchronous saves that write trainer_state/ too: rank 0 reads the adapter back at the commit.
    adapter_from_trainable_files: bool = False
    optimizer: object = None  # None: trainer_state/ without optimizer state
    scheduler: object = None
    model_only: bool = False  # no trainer_state/ (the HF Trainer's save_only_model)
    front_end_state_files: FrontEndFiles | None = None
    trainer_state_json: dict | bytes | None = None  # as of the save step
    merged_names: frozenset[str] | None = None  # a release-format export: the weights an adapter was merged into
    merged_subdirectory: str = ""
    release_files: SaveItem | None = None


_ITEM_OF: MappingProxyType[Part, Callable[[SaveSources], SaveItem | None]] = MappingProxyType({
    Part.MODEL_WEIGHTS: lambda sources: ModelWeights(),
    Part.MODEL_CONFIG: lambda sources: ModelConfig(),
    Part.ADAPTER: lambda sources: Adapter(write_files=sources.adapter_writer,
                                          from_trainable_files=sources.adapter_from_trainable_files),
    Part.TOKENIZER: lambda sources: Tokenizer(sources.tokenizer) if sources.tokenizer is not None else None,
    Part.FRONT_END_FILES: lambda sources: sources.front_end_files,
    Part.TRAINER_STATE_FILES: lambda sources: (None if sources.model_only else
                                               TrainerStateFiles(sources.optimizer, sources.scheduler)),
    Part.FRONT_END_STATE_FILES: lambda sources: sources.front_end_state_files,
    Part.TRAINER_STATE_JSON: lambda sources: (TrainerStateJson(sources.trainer_state_json)
                                              if sources.trainer_state_json is not None else None),
    Part.MERGED_WEIGHTS: lambda sources: ModelWeights(names=sources.merged_names,
                                                      subdirectory=sources.merged_subdirectory),
    Part.RELEASE_FILES: lambda sources: sources.release_files,
})


def model_kind(model: nn.Module) -> SaveKind:
    """The kind of save of ``model``'s weights: a PEFT model's adapter, or the full model."""
    return SaveKind.LORA_ADAPTER if is_peft_model(model) else SaveKind.FULL_MODEL


def declare(*kinds: SaveKind, sources: SaveSources = SaveSources()) -> list[SaveItem]:
    """The items a save of ``kinds`` writes, in order (every rank declares the same, at the save step): each kind's
    parts of :data:`SAVE_KINDS`, from what the front-end brings. The one place save items are listed."""
    items = [_ITEM_OF[part](sources) for kind in kinds for part in SAVE_KINDS[kind]]
    return [item for item in items if item is not None]


def pretrained_items(model: nn.Module, *, tokenizer=None) -> list[SaveItem]:
    """What ``save_pretrained`` writes: a full model's weights and config, or a PEFT model's adapter; the
    tokenizer."""
    return declare(model_kind(model), sources=SaveSources(tokenizer=tokenizer))


def checkpoint_items(model: nn.Module, *, optimizer, scheduler, trainer_state: dict, tokenizer=None,
                     save_optimizer: bool = True) -> list[SaveItem]:
    """What twinkle's Trainer writes into ``checkpoint-{step}/``: the model (or adapter) as ``save_pretrained``
    writes it, the tokenizer, ``trainer_state/`` and ``trainer_state.json``.

    An asynchronous save reads the adapter back at the commit from the trainable weights ``trainer_state/``
    holds (nothing gathered while training waits)."""
    sources = SaveSources(tokenizer=tokenizer, adapter_from_trainable_files=True,
                          optimizer=optimizer if save_optimizer else None, scheduler=scheduler,
                          trainer_state_json=copy.deepcopy(trainer_state))  # as of this step: training appends to it
    return declare(model_kind(model), SaveKind.TRAINER_STATE, sources=sources)


def save_pretrained(model: nn.Module, directory: str, *, ep_plan: ExpertParallelPlan | None,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, chunk_bytes: int = CHUNK_BYTES, tokenizer=None,
                    items: Sequence[SaveItem] | None = None) -> None:
    """``model`` as a Hugging Face checkpoint in ``directory`` (collective; ``NativeFSDPStrategy.save_pretrained``):
    :func:`pretrained_items`, or ``items`` (of :func:`declare`), published into ``directory`` (merged into it if
    it holds other files, under a marker loaders refuse until the end:
    :mod:`twinkle_strategy.checkpoint.directories`)."""
    directory = os.path.normpath(directory)
    check_shared_directory(os.path.dirname(os.path.abspath(directory)), what="the directory given to save_pretrained")
    items = pretrained_items(model, tokenizer=tokenizer) if items is None else items
    execute_save(SavePlan(directory, tuple(items), publish=Publish.MERGE, max_file_bytes=max_file_bytes,
                          chunk_bytes=chunk_bytes, subject=f"saving {directory}", advice="", report=False),
                 model=model, ep_plan=ep_plan)


def save_checkpoint(path: str, model: nn.Module, strategy: CheckpointedStrategy, *, optimizer, scheduler,
                    trainer_state: dict, tokenizer=None, save_optimizer: bool = True,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, chunk_bytes: int = CHUNK_BYTES) -> SaveReport:
    """Write ``path`` atomically (collective, synchronous: every rank calls it); returns this rank's report.

    Each step ends with a fail-together check instead of a plain barrier: if any rank cannot write (disk full,
    permissions), every rank raises the same error and the pending directory is removed. A process killed
    mid-save leaves only the pending directory, which resume ignores. A run's saves, asynchronous ones included:
    :class:`~twinkle_strategy.checkpoint.manager.CheckpointManager`.
    """
    items = checkpoint_items(model, optimizer=optimizer, scheduler=scheduler, trainer_state=trainer_state,
                             tokenizer=tokenizer, save_optimizer=save_optimizer)
    return execute_save(SavePlan(path, items, max_file_bytes=max_file_bytes, chunk_bytes=chunk_bytes),
                        model=model, ep_plan=strategy.ep_plan)


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
        raise ResumeError(f"{path} has no optimizer state ({STATE_DIR}/optimizer.json): it was saved "
                          "with its weights only, or by an older version; start a new run from its weights instead")
    for key, value in expect.items():
        if trainer_state.get(key) != value:
            raise ResumeError(f"checkpoint {path} was saved with {key}={trainer_state.get(key)}, this run has "
                              f"{key}={value}. {_EXPECT_HINTS.get(key, '')}".strip())
    load_trained_weights(path, model, strategy.ep_plan, stats=stats)
    load_trainer_state(path, model, strategy.ep_plan, optimizer=optimizer, scheduler=scheduler, stats=stats)
    return trainer_state


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
    "global_batch": ("The samples of each step depend on the global batch (micro-batch size x gradient "
                     "accumulation steps x data-parallel ranks): keep it, e.g. double the micro-batch size on half "
                     "the ranks."),
    "peft": "Resume a LoRA run with the same LoRA configuration, and a full run without one.",
}
