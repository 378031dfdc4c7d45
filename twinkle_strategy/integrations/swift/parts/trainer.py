"""swift's trainer on the shared transformers layer (:mod:`twinkle_strategy.integrations.transformers`).

What is swift's own: its save layout (``_save``, ``args.json``, ``--max_shard_size``), its ``last-checkpoint``
link, its tuner's adapter loading on resume, reading an older version's per-rank ``twinkle_state/`` once, and
its loss and token accuracy on a sequence-parallel chunk (:mod:`.sequence`).
``TWINKLE_ASYNC_SAVE=1`` saves in the background (the shared layer's ``async_save``), swift's files included.
"""

from __future__ import annotations

import logging
import os

import torch

from twinkle_strategy.checkpoint import ResumeError
from twinkle_strategy.checkpoint.save_plan import FrontEndFiles
from twinkle_strategy.checkpoint.training import SaveKind, SaveSources, model_kind
from twinkle_strategy.compat.transformers_internals import scheduler_file_name, trainer_save
from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.integrations.swift.parts.options import trainer_options
from twinkle_strategy.integrations.swift.parts.sequence import chunk_accuracy_inputs, serve_chunks
from twinkle_strategy.integrations.swift.parts.state import STATE, get_strategy
from twinkle_strategy.integrations.transformers import StrategyTrainerMixin, with_strategy
from twinkle_strategy.step.resume import refuse_unfinished, restore_trainer_state, restore_weights

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")

LEGACY_STATE_DIR = "twinkle_state"  # per-rank files of older versions, readable only at the same world size


def _legacy_local_state(checkpoint: str, strategy) -> dict | None:
    """An older checkpoint's ``twinkle_state/rank{R}.pt`` (same world size and ep_size only), or None."""
    directory = os.path.join(checkpoint, LEGACY_STATE_DIR)
    if not os.path.isdir(directory):
        return None
    path = os.path.join(directory, f"rank{strategy.rank}.pt")
    if not os.path.isfile(path):
        raise ResumeError(f"{checkpoint} has no {LEGACY_STATE_DIR}/rank{strategy.rank}.pt: it was saved with "
                          "another world size by an older version; resume with the same number of processes")
    local = torch.load(path, map_location="cpu", weights_only=False)
    layout = {"world_size": strategy.world_size, "ep_size": strategy.ep_size}
    if local["layout"] != layout:
        raise ResumeError(f"{checkpoint} was saved with {local['layout']}, this run has {layout}; "
                          "resume with the same parallel layout")
    if strategy.is_main_process:
        logger.warning("twinkle swift plugin: %s holds %s/ (an older version's per-rank state, same layout only); "
                       "read once: the next save writes trainer_state/, which resumes on any layout",
                       checkpoint, LEGACY_STATE_DIR)
    return local


def _legacy_state(trainer, checkpoint: str) -> dict | None:
    """``checkpoint``'s older per-rank state, read (and announced) once for the weights and the optimizer
    (a function, not a method: the trainer mixins' private methods are the HF Trainer's hooks only)."""
    if trainer._legacy_state_of is None or trainer._legacy_state_of[0] != checkpoint:
        trainer._legacy_state_of = (checkpoint, _legacy_local_state(checkpoint, trainer.strategy))
    return trainer._legacy_state_of[1]


def _optimizer_from_local(local: dict, optimizer) -> dict:
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in local["state"].items():
        p = params[int(i)]
        state[i] = {}
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.dim() > 0:
                v = DTensor.from_local(v.to(local_tensor(p).device), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride())
            state[i][k] = v
    return {"state": state, "param_groups": local["param_groups"]}


class TwinkleTrainerMixin(StrategyTrainerMixin):
    """What swift's trainer needs beyond any transformers.Trainer: swift's save layout, its tuner's resume."""

    # swift's --router_aux_loss_coef: swift sets the model's coefficient before every forward and adds the aux
    # loss itself (per micro-batch and rank); the global-batch one is not wired into swift's loss yet.
    replaces_model_aux_loss = False
    writes_run_log = False  # swift writes logging.jsonl and prints its checkpoints itself

    def __init__(self, *args, **kwargs):
        async_save = trainer_options(STATE.fsdp_options)["async_save"]
        super().__init__(*args, strategy=get_strategy(), async_save=async_save, **kwargs)
        self._legacy_state_of: tuple[str, dict | None] | None = None  # (checkpoint, its older per-rank state)
        if self.sequence_parallel:  # swift's loss on the strategy's chunks (.sequence)
            serve_chunks(self)

    def _compute_acc(self, outputs, labels, cu_seqlens=None) -> None:
        if self.sequence_parallel:  # a chunk's labels are shifted already
            outputs, labels = chunk_accuracy_inputs(outputs, labels)
        return super()._compute_acc(outputs, labels, cu_seqlens=cu_seqlens)

    @property
    def twinkle_strategy(self):
        return self.strategy

    def _clip_grad_norm(self, model):
        norm = self.clip_grad_norm(model)
        if not torch.isfinite(norm):  # like swift: skip this update instead of applying inf/NaN gradients
            for p in model.parameters():
                p.grad = None
        return norm

    # -- saving: the shared mixin's save_model and asynchronous checkpoints, with swift's own files (its _save)
    @property
    def checkpoint_shard_size(self):
        return self.args.max_shard_size  # swift's --max_shard_size

    def model_save_sources(self, *, adapter_from_trainable_files: bool) -> SaveSources:
        """What swift brings to a save of the model, synchronous (``save_model``) or asynchronous alike: every rank
        writes its rows of a full model, and process zero swift's own files (``_save``: its arguments, tokenizer,
        generation config); an adapter is PEFT's files then swift's, by rank 0 (asynchronously, at the commit once
        every rank has written the trainable weights it is read back from)."""
        should_save = self.args.should_save

        def write_swift_files(directory: str) -> None:
            trainer_save(self, directory, state_dict=None)

        if model_kind(self.model) == SaveKind.FULL_MODEL:
            return SaveSources(front_end_files=FrontEndFiles("swift's files", write_swift_files, every_rank=True,
                                                             here=should_save))

        def write_adapter(directory: str, state: dict) -> None:  # PEFT's adapter files, then swift's
            self.model.save_pretrained(directory, state_dict=state)
            if should_save:
                write_swift_files(directory)

        return SaveSources(adapter_writer=write_adapter, adapter_from_trainable_files=adapter_from_trainable_files)

    def checkpoint_started(self, path: str) -> None:
        # What swift's own _save_checkpoint notes first (its bookkeeping after train() reads it).
        self.state.last_model_checkpoint = path
        logger.info("twinkle swift plugin: saving model checkpoint to %s in the background", path)

    def checkpoint_committed(self, path: str) -> None:
        # swift >= 4.6 points <output_dir>/last-checkpoint at a checkpoint once it is fully written.
        try:
            from swift.utils import update_last_checkpoint_symlink
        except ImportError:
            return
        update_last_checkpoint_symlink(path)

    def _save_model(self, output_dir: str | None = None, state_dict=None):
        return  # written by every rank in save_model, config included

    # -- resuming: what a resumed step restores (twinkle_strategy.step.resume) from trainer_state/ (any layout), or
    # once an older twinkle_state/ (same layout)
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        refuse_unfinished(resume_from_checkpoint)
        legacy = _legacy_state(self, resume_from_checkpoint)
        if legacy is not None:
            params = dict((model or self.model).named_parameters())
            with torch.no_grad():
                for name, tensor in legacy["params"].items():
                    local_tensor(params[name]).copy_(tensor)
        elif not restore_weights(resume_from_checkpoint, model=model or self.model, strategy=self.strategy):
            if self.args.tuner_type == "full":  # no trainer_state/
                raise ResumeError(f"{resume_from_checkpoint} has no trainer_state/: it was saved with "
                                  "--save_only_model or without the twinkle plugin; start a new run with --model "
                                  f"{resume_from_checkpoint} instead of resuming")
            # the adapter was loaded by swift's tuner before the model was sharded
            logger.warning("twinkle swift plugin: %s has no trainer_state/: weights from the adapter, fresh "
                           "optimizer state", resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or self.args.resume_only_model:
            return
        legacy = _legacy_state(self, checkpoint)
        self._legacy_state_of = None  # read: its host copy is not needed any more
        if legacy is not None:
            self.optimizer.load_state_dict(_optimizer_from_local(legacy["optimizer"], self.optimizer))
            scheduler = os.path.join(checkpoint, scheduler_file_name())
            if os.path.isfile(scheduler):
                self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))
        else:  # (nothing without trainer_state/)
            restore_trainer_state(checkpoint, model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                                  scheduler=self.lr_scheduler)


def get_trainer_cls(orig, cls, args):
    """Hook of ``TrainerFactory.get_trainer_cls``: swift's trainer class with :class:`TwinkleTrainerMixin` first."""
    return with_strategy(orig.__func__(cls, args), mixin=TwinkleTrainerMixin)
