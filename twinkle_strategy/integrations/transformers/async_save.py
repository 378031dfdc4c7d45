"""Asynchronous checkpoints in ``transformers.Trainer`` and its subclasses (TRL's, ms-swift's): ``async_save=True``.

    trainer = with_strategy(Trainer)(model=model, args=args, strategy=strategy, async_save=True, ...)

A keyword of the trainer, next to ``strategy=``, not a ``TrainingArguments`` field: transformers' arguments
cannot take fields it does not know, and TRL's and swift's argument classes are theirs.

At a save step (:meth:`AsyncCheckpoints.save_checkpoint`, the mixin's ``_save_checkpoint``) every rank declares
what a synchronous save of the mixin writes, its model's and the trainer state's kinds of save
(:func:`twinkle_strategy.checkpoint.training.declare`, from what the trainer brings to them), and
the save executor copies them into host memory for the pending directory ``checkpoint-N.tmp``: the model's rows
(or, for an adapter, rank 0 writes it at the commit from the trainable weights every rank wrote), ``trainer_state/``, and the
Trainer's own files taken now and written later (``training_args.bin``, ``rng_state_<i>.pth``, the trainer
class's small files; ``trainer_state.json`` at the commit). Then training goes on while a thread per rank
writes them (:mod:`twinkle_strategy.checkpoint.background`). This module is also a ``TrainerCallback``:

* ``on_step_end``: the collective poll, on every rank at every optimizer step: a failed background write
  raises :class:`~twinkle_strategy.errors.CheckpointSaveError` there on every rank; once every rank has
  written, rank 0 commits (fsync, rename to ``checkpoint-N``, only then ``save_total_limit``'s rotation, which
  keeps the best checkpoint as the HF Trainer does).
* the save that ends training is awaited before ``train()`` goes on (best-model loading, swift's
  ``last``/``best`` bookkeeping), as is any save still in flight at the last epoch's end and at ``on_train_end``.

A save that comes while the previous one is still being written waits for it and logs how long.
``checkpoint-N.tmp`` never matches the HF Trainer's ``get_last_checkpoint`` (``^checkpoint-\\d+$``), and the
mixin refuses to resume from it: a run killed mid-write resumes from the previous checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from twinkle_strategy.checkpoint.background import AsyncSaves
from twinkle_strategy.checkpoint.manager import rotate_checkpoints
from twinkle_strategy.checkpoint.save_plan import FrontEndFiles, SavePlan, execute_save, write_bytes
from twinkle_strategy.checkpoint.training import STATE_FILE, SaveKind, declare, model_kind
from twinkle_strategy.compat.transformers_internals import file_size_bytes, save_rng_state
from twinkle_strategy.errors import CheckpointError


class AsyncCheckpoints(TrainerCallback):
    """The asynchronous saves of one trainer (every rank holds one), and the callback that polls them."""

    def __init__(self, trainer, *, pin_memory: bool) -> None:
        self.trainer = trainer
        self.saves = AsyncSaves(pin_memory=pin_memory, timeout_s=trainer.strategy.timeout_s)

    # -- the callback: collective, every rank at the same point of the training loop
    def on_step_end(self, args, state, control, **kwargs):
        self.saves.poll()

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_training_stop:  # before best-model loading and whatever follows train()
            self.saves.wait()

    def on_train_end(self, args, state, control, **kwargs):
        self.saves.wait()

    # -- the save
    def save_checkpoint(self) -> None:
        """The trainer's ``checkpoint-{global_step}``: its model's and the trainer state's kinds of save, declared
        and copied into host memory; written in the background (collective)."""
        trainer = self.trainer
        args, state = trainer.args, trainer.state
        trainer.store_flos()
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.saves.make_room(path)  # the previous save is durable: the best checkpoint noted below may be it
        with_trainer_state = not args.save_only_model
        trainer.checkpoint_started(path)
        sources = trainer.model_save_sources(adapter_from_trainable_files=with_trainer_state)
        self._note_best_checkpoint(path)
        rng_state = None
        if with_trainer_state:
            rng_files = files_written_by(functools.partial(save_rng_state, trainer))  # taken now, written later
            rng_state = FrontEndFiles("the RNG state", functools.partial(write_files, files=rng_files), every_rank=True)
        # The trainer state as the HF Trainer's own save writes it (its RNG state and trainer_state.json included).
        state_json = self._trainer_state_json() if args.should_save else None
        sources = dataclasses.replace(sources, optimizer=trainer.optimizer, scheduler=trainer.lr_scheduler,
                                      model_only=not with_trainer_state, front_end_state_files=rng_state,
                                      trainer_state_json=state_json)
        items = declare(model_kind(trainer.model), SaveKind.TRAINER_STATE, sources=sources)
        best = state.best_model_checkpoint

        def after_publish() -> None:  # rank 0, once the checkpoint is durable under its final name
            if args.should_save:
                rotate_checkpoints(args.output_dir, args.save_total_limit, best=best)
                trainer.checkpoint_committed(path)

        plan = SavePlan(path, tuple(items), max_file_bytes=file_size_bytes(trainer.checkpoint_shard_size),
                        chunk_bytes=trainer.strategy.init_bucket_bytes, after_publish=after_publish, report=False)
        execute_save(plan, model=trainer.model, ep_plan=trainer.strategy.ep_plan, background=self.saves)
        if trainer.control.should_training_stop:  # the last save of the run: durable before train() goes on
            self.saves.wait()

    def _note_best_checkpoint(self, path: str) -> None:
        """What the HF Trainer's save notes of the best checkpoint (the one being saved counts: it will exist)."""
        args, state = self.trainer.args, self.trainer.state
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
            best = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
            if best == path or os.path.exists(best):
                state.best_model_checkpoint = best

    def _trainer_state_json(self) -> bytes:
        """``trainer_state.json`` as the HF Trainer's save writes it, as of now (its callbacks' states included)."""
        trainer = self.trainer
        state = trainer.state
        for callback in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(callback.state())
                else:
                    state.stateful_callbacks[name] = callback.state()
        (data,) = files_written_by(lambda directory: state.save_to_json(os.path.join(directory, STATE_FILE))).values()
        return data


def files_written_by(write) -> dict[str, bytes]:
    """The files ``write(directory)`` writes into an empty local directory, by name: what a save must take at the
    save step and write later (the HF Trainer's RNG state), exactly as its own code writes it."""
    with tempfile.TemporaryDirectory(prefix="twinkle-async-save-") as directory:
        write(directory)
        files = {}
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
        return files


def write_files(directory: str, *, files: dict[str, bytes]) -> None:
    """``files`` (taken at the save step) into ``directory``."""
    for name, data in files.items():
        write_bytes(directory, name, data)


def refuse_unserved(training_args) -> None:
    """What asynchronous saves do not serve yet, refused in one line before training starts."""
    if getattr(training_args, "push_to_hub", False):
        raise CheckpointError("async_save=True does not push checkpoints to the Hub yet (TrainingArguments."
                              "push_to_hub=True): drop one of them, or push the final checkpoint after training")
