"""The HF Trainer's private hooks (which the strategy's mixin overrides or calls; swift's trainer subclasses it)
and accelerate's mark of a prepared model.
"""

from __future__ import annotations

from torch import nn

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import CHECKED

ACCELERATE_PREPARED = Internal(
    "model._is_accelerate_prepared", "accelerate",
    used_for="tell accelerate (which the HF Trainer under swift calls) that a model the strategy has sharded and "
             "placed is prepared already: Accelerator.prepare_model then neither wraps nor moves it",
    checked="1.15", replacement="none: accelerate has no public way to take a model that is distributed already")


@ACCELERATE_PREPARED.wrapper
def mark_accelerate_prepared(model: nn.Module) -> None:
    """Mark ``model`` as prepared, so that ``Accelerator.prepare_model`` returns it as it is."""
    model._is_accelerate_prepared = True


def _trainer_hook(name: str, used_for: str) -> Internal:
    return Internal(f"Trainer.{name}", "transformers", used_for=used_for, checked=CHECKED,
                    replacement="none: the HF Trainer (which swift's trainer subclasses) has no public hook for it")


# The HF Trainer's private methods the strategy's trainer mixin (integrations.transformers; swift's builds on it)
# overrides: a renamed one would silently never run.
TRAINER_HOOKS = {internal.name.split(".", 1)[1]: internal for internal in (
    _trainer_hook("_move_model_to_device", "leave a sharded model where the strategy placed it"),
    _trainer_hook("_clip_grad_norm", "clip the gradient norm over the expert and the non-expert meshes"),
    _trainer_hook("_get_grad_norm", "report the gradient norm over the expert and the non-expert meshes"),
    _trainer_hook("_save_optimizer_and_scheduler", "save each rank's own optimizer shards"),
    _trainer_hook("_load_from_checkpoint", "resume each rank's own trainable shards"),
    _trainer_hook("_load_optimizer_and_scheduler", "resume each rank's own optimizer shards"),
    _trainer_hook("_save_checkpoint", "save a checkpoint asynchronously (staged in host memory, written by a "
                                      "background thread into checkpoint-N.tmp, renamed once complete), and call "
                                      "the trainer class's own otherwise"),
)}


def check_trainer_overrides(mixin: type) -> None:
    """Raise if the installed transformers ``Trainer`` no longer has a private hook that ``mixin`` overrides."""
    from transformers import Trainer

    for name, internal in TRAINER_HOOKS.items():
        if name in vars(mixin) and not hasattr(Trainer, name):
            raise internal.changed("is gone, so its override would never run")


for _internal in TRAINER_HOOKS.values():
    _internal.wrapper(check_trainer_overrides)


@TRAINER_HOOKS["_save_checkpoint"].wrapper
def parent_save_checkpoint(trainer, mixin: type, model, trial) -> None:
    """The ``_save_checkpoint`` of the class after ``mixin`` in ``trainer``'s MRO (swift's, then the HF Trainer's)."""
    TRAINER_HOOKS["_save_checkpoint"].attribute(super(mixin, trainer), "_save_checkpoint")(model, trial)


SAVE_RNG_STATE = Internal(
    "Trainer._save_rng_state", "transformers",
    used_for="take a checkpoint's RNG state files (rng_state_<process>.pth) exactly as the HF Trainer writes them, "
             "at the save step, for an asynchronous save to write later",
    checked=CHECKED, replacement="none: the HF Trainer has no public way to save or read its RNG state")


@SAVE_RNG_STATE.wrapper
def save_rng_state(trainer, directory: str) -> None:
    """``trainer._save_rng_state(directory)``: this process's RNG state file(s), as the HF Trainer saves them."""
    SAVE_RNG_STATE.attribute(trainer, "_save_rng_state")(directory)


TRAINER_SAVE = Internal(
    "Trainer._save", "transformers",
    used_for="let swift write what a save holds besides the weights (config, tokenizer, arguments) once every "
             "rank has written its rows",
    checked=CHECKED, replacement="none: the public save_model also gathers and writes the weights")


@TRAINER_SAVE.wrapper
def trainer_save(trainer, output_dir: str, state_dict=None) -> None:
    """``trainer._save(output_dir, state_dict=state_dict)``: the HF Trainer's save of one process."""
    TRAINER_SAVE.attribute(trainer, "_save")(output_dir, state_dict=state_dict)


TRAINER_PREPARE_INPUTS = Internal(
    "Trainer._prepare_inputs", "transformers",
    used_for="put a step's micro-batches on the device as the training step does, for the gradient-free routing "
             "pass of the global-batch aux loss before the step's first backward",
    checked=CHECKED, replacement="none: the HF Trainer has no public method that prepares a batch")


@TRAINER_PREPARE_INPUTS.wrapper
def trainer_prepare_inputs(trainer, inputs: dict) -> dict:
    """``trainer._prepare_inputs(inputs)``: a micro-batch as the HF Trainer's training step hands it to the model."""
    return TRAINER_PREPARE_INPUTS.attribute(trainer, "_prepare_inputs")(inputs)


SCHEDULER_FILE = Internal(
    "trainer.SCHEDULER_NAME", "transformers",
    used_for="save and resume the learning-rate scheduler under the file name the HF Trainer uses",
    checked=CHECKED, replacement="none: transformers.trainer does not export it")


@SCHEDULER_FILE.wrapper
def scheduler_file_name() -> str:
    """The file a checkpoint of the HF Trainer keeps the scheduler's state in ('scheduler.pt')."""
    return SCHEDULER_FILE.import_name("transformers.trainer", "SCHEDULER_NAME")
