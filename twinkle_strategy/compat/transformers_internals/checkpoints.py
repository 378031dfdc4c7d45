"""How transformers reads and writes hub checkpoints: the key conversion rules (renames, per-expert keys merged)
and their order, the rules a load recorded, FP8 scale renames, the keys to ignore, a shard's size.
"""

from __future__ import annotations

import inspect
import types

from torch import nn

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import (
    CHECKED,
    LOADING_MODULE,
    NO_PUBLIC_API,
    require_on_pretrained_model,
)

CONVERSION_MAPPING = Internal(
    "conversion_mapping.get_model_conversion_mapping", "transformers",
    used_for="ask for the rules that turn a model class's hub checkpoint keys into its tensors (renames, "
             "per-expert keys merged), so that reading and saving never hand-write a key map",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@CONVERSION_MAPPING.wrapper
def conversion_rules(model, *, add_legacy: bool = True) -> list:
    """transformers' conversion rules (WeightRenaming and WeightConverter objects) for ``model``'s class."""
    get = CONVERSION_MAPPING.import_name("transformers.conversion_mapping", "get_model_conversion_mapping")
    return get(model, key_mapping=None, hf_quantizer=None, add_legacy=add_legacy)


def _rule(name: str, used_for: str, checked: str = CHECKED) -> Internal:
    return Internal(f"core_model_loading.{name}", "transformers", used_for=used_for, checked=checked,
                    replacement=NO_PUBLIC_API)


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
    module = internal.import_name(LOADING_MODULE)
    if optional:
        return getattr(module, name, None)
    return internal.attribute(module, name)


for _internal in RULE_CLASSES.values():
    _internal.wrapper(rule_class)


NATURAL_KEY = Internal(
    "core_model_loading.dot_natural_key", "transformers",
    used_for="order checkpoint keys as transformers does (per-expert keys are merged in that order, and saved "
             "files list them so)",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@NATURAL_KEY.wrapper
def natural_order(keys) -> list[str]:
    """``keys`` sorted as transformers sorts checkpoint keys (numbers by value: expert 2 before expert 10)."""
    return sorted(keys, key=NATURAL_KEY.import_name(LOADING_MODULE, "dot_natural_key"))


RENAME_SOURCE_KEY = Internal(
    "core_model_loading.rename_source_key", "transformers",
    used_for="find which model tensor (and which rule's source pattern) a checkpoint key belongs to, as "
             "from_pretrained does",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@RENAME_SOURCE_KEY.wrapper
def rename_source_key(key: str, renamings: list, converters: list, base_model_prefix: str | None,
                      model_tensors: dict) -> tuple[str, str | None]:
    """``(model key, matching source pattern or None)`` of checkpoint key ``key``, given the model's tensors."""
    rename = RENAME_SOURCE_KEY.import_name(LOADING_MODULE, "rename_source_key")
    return rename(key, renamings, converters, base_model_prefix, model_tensors)


WEIGHT_CONVERSIONS = Internal(
    "PreTrainedModel._weight_conversions", "transformers",
    used_for="know (and tell every rank) the conversion rules that matched when the checkpoint was loaded, "
             "which save_pretrained reverses to write the checkpoint's own key layout",
    checked=CHECKED, replacement="none: from_pretrained records the rules only there")


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
    checked=CHECKED, replacement="none: save_pretrained applies it to a whole in-memory state dict only")


@REVERT_WEIGHT_CONVERSION.wrapper
@WEIGHT_CONVERSIONS.wrapper
def revert_weight_conversion(rules: list, config, get_parameter, state_dict: dict) -> dict:
    """``state_dict`` (model keys) as the checkpoint tensors the reversed ``rules`` make, as ``save_pretrained``
    writes them; ``get_parameter(name)`` answers the reversed operations' shape lookups."""
    revert = REVERT_WEIGHT_CONVERSION.import_name(LOADING_MODULE, "revert_weight_conversion")
    model = types.SimpleNamespace(_weight_conversions=list(rules), config=config, get_parameter=get_parameter)
    return revert(model, state_dict)


KEYS_TO_IGNORE_UNEXPECTED = Internal(
    "PreTrainedModel._keys_to_ignore_on_load_unexpected", "transformers",
    used_for="not report checkpoint keys the model class says to ignore (DeepSeek-V3's MTP layers)",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@KEYS_TO_IGNORE_UNEXPECTED.wrapper
def keys_to_ignore_on_load_unexpected(model) -> list[str]:
    """The regexes of checkpoint keys ``model``'s class expects in checkpoints and does not load."""
    require_on_pretrained_model(KEYS_TO_IGNORE_UNEXPECTED, "_keys_to_ignore_on_load_unexpected")
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



FILE_SIZE = Internal(
    "utils.hub.convert_file_size_to_int", "transformers",
    used_for="read max_shard_size ('5GB', '500MiB') exactly as save_pretrained reads it",
    checked=CHECKED, replacement="none in transformers' public API")


@FILE_SIZE.wrapper
def file_size_bytes(size: int | str) -> int:
    """``size`` ('5GB', '500MiB' or a number of bytes) in bytes, as ``save_pretrained(max_shard_size=...)``."""
    return FILE_SIZE.import_name("transformers.utils.hub", "convert_file_size_to_int")(size)
