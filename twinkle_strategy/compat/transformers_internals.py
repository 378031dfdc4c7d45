"""What twinkle_strategy takes from transformers' internals (and accelerate's, which its Trainer drives).

Each wrapper is declared with an :class:`~twinkle_strategy.compat.Internal` (what it is used for,
the versions checked, the public replacement) and tested in ``tests/unit/test_internals.py``.
transformers is imported inside the wrappers, never at import time.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn

from twinkle_strategy.compat.registry import Internal

_LOADING = "transformers.core_model_loading"
_ALL = "5.19, 5.23, 5.24"
_NONE = "none (transformers 5.24 has no public API for it)"


def _require_on_pretrained_model(entry: Internal, attr: str) -> None:
    """Raise ``entry.changed()`` if transformers' ``PreTrainedModel`` no longer declares class attribute ``attr``
    (read from instances with a default, its absence would otherwise pass unnoticed)."""
    if not _declared_by_pretrained_model(attr):
        raise entry.changed()


@functools.cache
def _declared_by_pretrained_model(attr: str) -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, attr)


# ------------------------------------------------------------------ dtypes from_pretrained keeps
DTYPE_PLAN = Internal(
    "PreTrainedModel._get_dtype_plan", "transformers",
    used_for="ask which tensors from_pretrained(dtype=...) keeps in fp32 (which list applies to which dtype), so "
             "that a model built from its config and FSDP2's units give the same dtypes as from_pretrained",
    checked=_ALL, replacement=_NONE)


@DTYPE_PLAN.wrapper
def dtype_plan(pretrained, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Name glob -> dtype that ``from_pretrained(dtype=dtype)`` gives the transformers model ``pretrained``."""
    return dict(DTYPE_PLAN.attribute(pretrained, "_get_dtype_plan")(dtype))


KEEP_IN_FP32_STRICT = Internal(
    "PreTrainedModel._keep_in_fp32_modules_strict", "transformers",
    used_for="say, in an error message, which of the model class's lists keeps a tensor in fp32",
    checked=_ALL, replacement=_NONE)


@KEEP_IN_FP32_STRICT.wrapper
def keep_in_fp32_strict(pretrained) -> set[str]:
    """The globs ``pretrained``'s class keeps in fp32 under bf16 and fp16 alike."""
    _require_on_pretrained_model(KEEP_IN_FP32_STRICT, "_keep_in_fp32_modules_strict")
    return set(getattr(pretrained, "_keep_in_fp32_modules_strict", None) or ())


GLOB_ALTERNATION = Internal(
    "core_model_loading.build_glob_alternation", "transformers",
    used_for="match the dtype plan's globs against tensor names exactly as from_pretrained matches them",
    checked=_ALL, replacement=_NONE)


@GLOB_ALTERNATION.wrapper
def glob_alternation(globs: list[str]):
    """``(regex, group name -> glob)``: one alternation of ``globs``, searched in a tensor name; the match's
    ``lastgroup`` names the glob that decides."""
    build = GLOB_ALTERNATION.import_name(_LOADING, "build_glob_alternation")
    alternation, glob_of_group, *_ = build(list(globs))
    return alternation, glob_of_group


# ------------------------------------------------------------------ checkpoint key layouts
CONVERSION_MAPPING = Internal(
    "conversion_mapping.get_model_conversion_mapping", "transformers",
    used_for="ask for the rules that turn a model class's hub checkpoint keys into its tensors (renames, "
             "per-expert keys merged), so that reading and saving never hand-write a key map",
    checked=_ALL, replacement=_NONE)


@CONVERSION_MAPPING.wrapper
def conversion_rules(model, *, add_legacy: bool = True) -> list:
    """transformers' conversion rules (WeightRenaming and WeightConverter objects) for ``model``'s class."""
    get = CONVERSION_MAPPING.import_name("transformers.conversion_mapping", "get_model_conversion_mapping")
    return get(model, key_mapping=None, hf_quantizer=None, add_legacy=add_legacy)


def _rule(name: str, used_for: str, checked: str = _ALL) -> Internal:
    return Internal(f"core_model_loading.{name}", "transformers", used_for=used_for, checked=checked,
                    replacement=_NONE)


_ALONG_A_DIM = ("recognise an operation along a dim > 0, which leaves the rows (dim 0) of a tensor readable "
                "and writable piece by piece")
RULE_CLASSES = {internal.name.rsplit(".", 1)[1]: internal for internal in (
    _rule("WeightRenaming", "recognise and build the rules that rename one checkpoint key to one model key"),
    _rule("WeightConverter", "recognise and run the rules that make model tensors from several checkpoint tensors"),
    _rule("PrefixChange", "leave out prefix rules when saving a model that from_pretrained did not load, as "
                          "save_pretrained does"),
    _rule("MergeModulelist", "recognise per-expert checkpoint keys stacked on dim 0, so that a rank reads only "
                             "its own experts' keys"),
    _rule("SplitModulelist", "write each expert's rows under its own checkpoint key when saving"),
    _rule("Concatenate", _ALONG_A_DIM),
    _rule("Chunk", _ALONG_A_DIM),
    _rule("Split", _ALONG_A_DIM, checked="5.23, 5.24 (5.19 has none: rule_class(..., optional=True) gives None)"),
    _rule("Interleave", _ALONG_A_DIM),
    _rule("Transpose", _ALONG_A_DIM),
)}


def rule_class(name: str, *, optional: bool = False) -> type | None:
    """The conversion rule or operation class ``name`` of transformers' ``core_model_loading``.

    ``optional``: None where the installed version has no such class (an operation newer than it).
    """
    internal = RULE_CLASSES[name]
    module = internal.import_name(_LOADING)
    if optional:
        return getattr(module, name, None)
    return internal.attribute(module, name)


for _internal in RULE_CLASSES.values():
    _internal.wrapper(rule_class)


NATURAL_KEY = Internal(
    "core_model_loading.dot_natural_key", "transformers",
    used_for="order checkpoint keys as transformers does (per-expert keys are merged in that order, and saved "
             "files list them so)",
    checked=_ALL, replacement=_NONE)


@NATURAL_KEY.wrapper
def natural_order(keys) -> list[str]:
    """``keys`` sorted as transformers sorts checkpoint keys (numbers by value: expert 2 before expert 10)."""
    return sorted(keys, key=NATURAL_KEY.import_name(_LOADING, "dot_natural_key"))


RENAME_SOURCE_KEY = Internal(
    "core_model_loading.rename_source_key", "transformers",
    used_for="find which model tensor (and which rule's source pattern) a checkpoint key belongs to, as "
             "from_pretrained does",
    checked=_ALL, replacement=_NONE)


@RENAME_SOURCE_KEY.wrapper
def rename_source_key(key: str, renamings: list, converters: list, base_model_prefix: str | None,
                      model_tensors: dict) -> tuple[str, str | None]:
    """``(model key, matching source pattern or None)`` of checkpoint key ``key``, given the model's tensors."""
    rename = RENAME_SOURCE_KEY.import_name(_LOADING, "rename_source_key")
    return rename(key, renamings, converters, base_model_prefix, model_tensors)


WEIGHT_CONVERSIONS = Internal(
    "PreTrainedModel._weight_conversions", "transformers",
    used_for="know (and tell every rank) the conversion rules that matched when the checkpoint was loaded, "
             "which save_pretrained reverses to write the checkpoint's own key layout",
    checked=_ALL, replacement="none: from_pretrained records the rules only there")


@WEIGHT_CONVERSIONS.wrapper
def weight_conversions(model) -> list | None:
    """The conversion rules ``from_pretrained`` recorded on ``model`` (None for a model it did not load)."""
    return getattr(model, "_weight_conversions", None)


@WEIGHT_CONVERSIONS.wrapper
def set_weight_conversions(model, rules: list) -> None:
    """Record ``rules`` on ``model`` as ``from_pretrained`` does, so that saving reverses them."""
    model._weight_conversions = rules


REVERT_WEIGHT_CONVERSION = Internal(
    "core_model_loading.revert_weight_conversion", "transformers",
    used_for="name and shape the checkpoint tensors a save writes, by transformers' rules reversed",
    checked=_ALL, replacement="none: save_pretrained applies it to a whole in-memory state dict only")


@REVERT_WEIGHT_CONVERSION.wrapper
@WEIGHT_CONVERSIONS.wrapper
def revert_weight_conversion(rules: list, config, get_parameter, state_dict: dict) -> dict:
    """``state_dict`` (model keys) as the checkpoint tensors the reversed ``rules`` make, as ``save_pretrained``
    writes them; ``get_parameter(name)`` answers the reversed operations' shape lookups."""
    revert = REVERT_WEIGHT_CONVERSION.import_name(_LOADING, "revert_weight_conversion")
    model = types.SimpleNamespace(_weight_conversions=list(rules), config=config, get_parameter=get_parameter)
    return revert(model, state_dict)


KEYS_TO_IGNORE_UNEXPECTED = Internal(
    "PreTrainedModel._keys_to_ignore_on_load_unexpected", "transformers",
    used_for="not report checkpoint keys the model class says to ignore (DeepSeek-V3's MTP layers)",
    checked=_ALL, replacement=_NONE)


@KEYS_TO_IGNORE_UNEXPECTED.wrapper
def keys_to_ignore_on_load_unexpected(model) -> list[str]:
    """The regexes of checkpoint keys ``model``'s class expects in checkpoints and does not load."""
    _require_on_pretrained_model(KEYS_TO_IGNORE_UNEXPECTED, "_keys_to_ignore_on_load_unexpected")
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


FP8_SCALE_RENAMES = Internal(
    "FineGrainedFP8HfQuantizer.update_weight_conversions", "transformers",
    used_for="pair each FP8 weight of a quantized release with its scale by the quantizer's own renames of "
             "scale keys (DeepSeek-V4's .scale, Mistral's .qscale_weight)",
    checked="5.19 (no model argument), 5.23, 5.24",
    replacement="none: from_pretrained applies the renames inside its loading only")


@FP8_SCALE_RENAMES.wrapper
def fp8_scale_renamings(model=None) -> list:
    """transformers' FP8 quantizer renames of scale keys (WeightRenaming rules) for ``model`` (None: any model)."""
    from transformers import FineGrainedFP8Config

    module = FP8_SCALE_RENAMES.import_name("transformers.quantizers.quantizer_finegrained_fp8")
    quantizer = FP8_SCALE_RENAMES.attribute(module, "FineGrainedFP8HfQuantizer")(
        FineGrainedFP8Config(dequantize=True), pre_quantized=True)
    update = FP8_SCALE_RENAMES.attribute(quantizer, "update_weight_conversions")
    # 5.23 asks the model for its parameters, 5.24 for its config's model_type, 5.19 for nothing.
    takes_model = "model" in inspect.signature(update).parameters
    rules = update([], model if model is not None else _any_model()) if takes_model else update([])
    renaming = rule_class("WeightRenaming")
    return [rule for rule in rules if isinstance(rule, renaming)]


def _any_model() -> nn.Module:
    """A model of no particular family: no parameters, a config without a model type."""
    model = nn.Module()
    model.config = types.SimpleNamespace(model_type="")
    return model


# ------------------------------------------------------------------ building a model
FROM_CONFIG = Internal(
    "PreTrainedModel._from_config", "transformers",
    used_for="build a concrete model class (as ms-swift passes one) from its config, in a dtype, on meta",
    checked=_ALL,
    replacement="AutoModel*.from_config, used whenever the class has it; a concrete class has no public "
                "builder that applies dtype and attention implementation (its constructor does neither)")


@FROM_CONFIG.wrapper
def build_from_config(model_class, config, **kwargs):
    """``model_class`` built from ``config``: ``from_config`` for auto classes, ``_from_config`` for others."""
    build = getattr(model_class, "from_config", None) or FROM_CONFIG.attribute(model_class, "_from_config")
    return build(config, **kwargs)


INIT_WEIGHTS = Internal(
    "PreTrainedModel._init_weights", "transformers",
    used_for="compute the non-persistent buffers of a model built on meta (RoPE inv_freq) as from_pretrained "
             "does, one module at a time",
    checked=_ALL,
    replacement="none: the public initialize_weights() initialises the whole model, whose weights are on meta")


@INIT_WEIGHTS.wrapper
def init_weights(pretrained, module: nn.Module) -> None:
    """Let the transformers model ``pretrained`` initialise ``module`` (one of its modules) as it does on load."""
    INIT_WEIGHTS.attribute(pretrained, "_init_weights")(module)


NO_SPLIT_MODULES = Internal(
    "PreTrainedModel._no_split_modules", "transformers",
    used_for="find the repeated decoder layers (FSDP2 units, activation checkpointing) by their class names",
    checked=_ALL, replacement=_NONE)


@NO_SPLIT_MODULES.wrapper
def no_split_modules(module: nn.Module):
    """The class names ``module`` lists as blocks never to split (its decoder layers); empty if none."""
    _require_on_pretrained_model(NO_SPLIT_MODULES, "_no_split_modules")
    return getattr(module, "_no_split_modules", None) or ()


# ------------------------------------------------------------------ activation checkpointing
CHECKPOINTING_FUNCTION = Internal(
    "GradientCheckpointingLayer._gradient_checkpointing_func", "transformers",
    used_for="make the layers transformers checkpoints recompute through our context_fn (the EP dispatch "
             "replayed, not sent again)",
    checked=_ALL, replacement="none: the checkpoint function is set only through the enabling call's kwargs")


@CHECKPOINTING_FUNCTION.wrapper
def wrap_checkpointing_function(module: nn.Module, wrap) -> None:
    """If transformers checkpoints ``module`` now, replace the function it recomputes it with by ``wrap(func)``."""
    func = getattr(module, "_gradient_checkpointing_func", None)
    if getattr(module, "gradient_checkpointing", False) and func is not None:
        module._gradient_checkpointing_func = wrap(func)


CHECKPOINTING_ENABLE = Internal(
    "PreTrainedModel._activation_checkpointing_enable", "transformers",
    used_for="make every later enabling of transformers' activation checkpointing (swift, the HF Trainer) use "
             "our context_fn: every public enabling call goes through this method",
    checked="5.23, 5.24 (5.19 has none: its gradient_checkpointing_enable, the one path, is wrapped instead)",
    replacement="none: the public activation_checkpointing_enable takes its caller's kwargs, to which we must "
                "add context_fn")


@CHECKPOINTING_ENABLE.wrapper
def wrap_checkpointing_enable(module: nn.Module, wrap) -> None:
    """Replace, on ``module``, the method every enabling of transformers' activation checkpointing goes through
    by ``wrap(method)`` (unless that returns the method itself); nothing for a module without one."""
    if hasattr(module, "activation_checkpointing_enable"):
        name = "_activation_checkpointing_enable"
        if not hasattr(module, name):
            raise CHECKPOINTING_ENABLE.changed()
    elif hasattr(module, "gradient_checkpointing_enable"):  # transformers 5.19
        name = "gradient_checkpointing_enable"
    else:
        return
    method = getattr(module, name)
    wrapped = wrap(method)
    if wrapped is not method:
        setattr(module, name, wrapped)


ENABLE_CHECKPOINTING = Internal(
    "PreTrainedModel.activation_checkpointing_enable", "transformers",
    used_for="enable transformers' activation checkpointing under its current name (gradient_checkpointing_enable, "
             "deprecated since, on 5.19)",
    checked="5.19 (gradient_checkpointing_enable), 5.23, 5.24",
    replacement="it is public; the deprecated gradient_checkpointing_enable goes in transformers v6")


@ENABLE_CHECKPOINTING.wrapper
def enable_activation_checkpointing(model: nn.Module, checkpointing_kwargs: dict | None = None) -> None:
    """``model.activation_checkpointing_enable(kwargs)``, or ``gradient_checkpointing_enable`` where older."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
    else:
        ENABLE_CHECKPOINTING.attribute(model, "gradient_checkpointing_enable")(
            gradient_checkpointing_kwargs=checkpointing_kwargs)


IS_CHECKPOINTING = Internal(
    "PreTrainedModel.is_activation_checkpointing", "transformers",
    used_for="ask whether transformers' activation checkpointing is on, under its current name "
             "(is_gradient_checkpointing, deprecated since, on 5.19)",
    checked="5.19 (is_gradient_checkpointing), 5.23, 5.24",
    replacement="it is public; the deprecated is_gradient_checkpointing goes in transformers v6")


@IS_CHECKPOINTING.wrapper
def is_activation_checkpointing(model: nn.Module) -> bool:
    """``model.is_activation_checkpointing``, or ``is_gradient_checkpointing`` where older."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the new name first: no warning
        try:
            return bool(getattr(model, name))
        except AttributeError:
            continue
    raise IS_CHECKPOINTING.changed()


# ------------------------------------------------------------------ saving and the HF Trainer
FILE_SIZE = Internal(
    "utils.hub.convert_file_size_to_int", "transformers",
    used_for="read max_shard_size ('5GB', '500MiB') exactly as save_pretrained reads it",
    checked=_ALL, replacement="none in transformers' public API")


@FILE_SIZE.wrapper
def file_size_bytes(size: int | str) -> int:
    """``size`` ('5GB', '500MiB' or a number of bytes) in bytes, as ``save_pretrained(max_shard_size=...)``."""
    return FILE_SIZE.import_name("transformers.utils.hub", "convert_file_size_to_int")(size)


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
    return Internal(f"Trainer.{name}", "transformers", used_for=used_for, checked=_ALL,
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
    checked=_ALL, replacement="none: the HF Trainer has no public way to save or read its RNG state")


@SAVE_RNG_STATE.wrapper
def save_rng_state(trainer, directory: str) -> None:
    """``trainer._save_rng_state(directory)``: this process's RNG state file(s), as the HF Trainer saves them."""
    SAVE_RNG_STATE.attribute(trainer, "_save_rng_state")(directory)


TRAINER_SAVE = Internal(
    "Trainer._save", "transformers",
    used_for="let swift write what a save holds besides the weights (config, tokenizer, arguments) once every "
             "rank has written its rows",
    checked=_ALL, replacement="none: the public save_model also gathers and writes the weights")


@TRAINER_SAVE.wrapper
def trainer_save(trainer, output_dir: str, state_dict=None) -> None:
    """``trainer._save(output_dir, state_dict=state_dict)``: the HF Trainer's save of one process."""
    TRAINER_SAVE.attribute(trainer, "_save")(output_dir, state_dict=state_dict)


TRAINER_PREPARE_INPUTS = Internal(
    "Trainer._prepare_inputs", "transformers",
    used_for="put a step's micro-batches on the device as the training step does, for the gradient-free routing "
             "pass of the global-batch aux loss before the step's first backward",
    checked=_ALL, replacement="none: the HF Trainer has no public method that prepares a batch")


@TRAINER_PREPARE_INPUTS.wrapper
def trainer_prepare_inputs(trainer, inputs: dict) -> dict:
    """``trainer._prepare_inputs(inputs)``: a micro-batch as the HF Trainer's training step hands it to the model."""
    return TRAINER_PREPARE_INPUTS.attribute(trainer, "_prepare_inputs")(inputs)


SCHEDULER_FILE = Internal(
    "trainer.SCHEDULER_NAME", "transformers",
    used_for="save and resume the learning-rate scheduler under the file name the HF Trainer uses",
    checked=_ALL, replacement="none: transformers.trainer does not export it")


@SCHEDULER_FILE.wrapper
def scheduler_file_name() -> str:
    """The file a checkpoint of the HF Trainer keeps the scheduler's state in ('scheduler.pt')."""
    return SCHEDULER_FILE.import_name("transformers.trainer", "SCHEDULER_NAME")


# ------------------------------------------------------------------ sequence parallelism
ATTN_IMPLEMENTATION = Internal(
    "PreTrainedConfig._attn_implementation", "transformers",
    used_for="read which attention function a model was loaded with (Ulysses wraps that one), and build the "
             "whole sequence's mask with a copy of the config that names it",
    checked=_ALL, replacement="none for reading it (set_attn_implementation only sets it; the attention-interface "
                              "docs read config._attn_implementation themselves)")


@ATTN_IMPLEMENTATION.wrapper
def attention_implementation(config) -> str | None:
    """The name of the attention function ``config``'s model calls (``"sdpa"``, ``"flash_attention_2"`` ...)."""
    return ATTN_IMPLEMENTATION.attribute(config, "_attn_implementation")


@ATTN_IMPLEMENTATION.wrapper
def config_with_attention(config, implementation: str):
    """A shallow copy of ``config`` whose models call ``implementation``: what transformers' mask functions read."""
    import copy

    ATTN_IMPLEMENTATION.attribute(config, "_attn_implementation")
    changed = copy.copy(config)
    changed._attn_implementation = implementation
    return changed


# ------------------------------------------------------------------ the MoE load-balancing loss
BALANCING_LOSS_FUNCTION = Internal(
    "modeling_<family>.load_balancing_loss_func", "transformers",
    used_for="evaluate an MoE family's own load-balancing loss on given router logits (cast to fp32, and in their "
             "own dtype), to judge in bf16 as in fp32 whether it is the Switch-Transformer form counted over the "
             "global batch",
    checked="5.19, 5.24", replacement="none: the models compute it inside their forward only")

_BALANCING_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@BALANCING_LOSS_FUNCTION.wrapper
def balancing_loss_function(model: nn.Module):
    """The ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` that ``model``'s forward
    calls: a global of the modeling module of its class, or of the nearest base class whose module has one (a
    subclass defined elsewhere inherits its forward). None where none has one with those parameters (remote
    code, Switch-Transformers' own signature)."""
    import sys

    for cls in type(model).__mro__:
        function = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if callable(function):
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):
                return None
            return function if tuple(parameters)[:4] == _BALANCING_PARAMETERS else None
    return None
