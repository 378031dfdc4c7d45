"""The wrappers of transformers' internals (and accelerate's, which its Trainer drives; PEFT's one), one module per
area.

dtypes.py                    which tensors from_pretrained keeps in fp32 (the dtype plan, its globs matched)
checkpoints.py               hub checkpoint keys: conversion rules, their order, recorded and reversed; FP8 scale
                             renames; shard sizes read as save_pretrained reads them
building.py                  a model built as transformers builds it: from its config, one module's init, its layers
activation_checkpointing.py  transformers' activation checkpointing enabled, asked, recomputed through our context_fn
trainer.py                   the HF Trainer's private hooks the strategy's mixin overrides or calls; accelerate's mark
modeling.py                  what a model's forward calls: its attention implementation, its load-balancing loss,
                             its experts' implementation and gate; PEFT's LoRA factors on fused expert tensors
checked.py                   what they share: the versions checked, "no public API", a PreTrainedModel attribute's check

Each wrapper is declared with an :class:`~twinkle_strategy.compat.Internal` (what it is used for, the versions
checked, the public replacement) and tested in ``tests/unit/test_internals.py``. This face names every wrapper, so a
caller imports it from here whatever its area; importing it declares them all (the registry, ``python -m
twinkle_strategy.compat``). transformers is imported inside the wrappers, never at import time.
"""

from twinkle_strategy.compat.transformers_internals.activation_checkpointing import (
    enable_activation_checkpointing,
    is_activation_checkpointing,
    wrap_checkpointing_enable,
    wrap_checkpointing_function,
)
from twinkle_strategy.compat.transformers_internals.building import (
    build_from_config,
    init_weights,
    no_split_modules,
)
from twinkle_strategy.compat.transformers_internals.checkpoints import (
    RULE_CLASSES,
    conversion_rules,
    file_size_bytes,
    fp8_scale_renamings,
    keys_to_ignore_on_load_unexpected,
    natural_order,
    rename_source_key,
    revert_weight_conversion,
    rule_class,
    set_weight_conversions,
    weight_conversions,
)
from twinkle_strategy.compat.transformers_internals.dtypes import (
    dtype_plan,
    glob_alternation,
    keep_in_fp32_strict,
)
from twinkle_strategy.compat.transformers_internals.modeling import (
    attention_implementation,
    balancing_loss_function,
    config_with_attention,
    experts_gate,
    experts_implementation,
    lora_delta_factors,
    under_transformers_expert_parallel,
)
from twinkle_strategy.compat.transformers_internals.trainer import (
    TRAINER_HOOKS,
    check_trainer_overrides,
    mark_accelerate_prepared,
    parent_save_checkpoint,
    save_rng_state,
    scheduler_file_name,
    trainer_prepare_inputs,
    trainer_save,
)

__all__ = [
    "RULE_CLASSES",
    "TRAINER_HOOKS",
    "attention_implementation",
    "balancing_loss_function",
    "build_from_config",
    "check_trainer_overrides",
    "config_with_attention",
    "conversion_rules",
    "dtype_plan",
    "enable_activation_checkpointing",
    "experts_gate",
    "experts_implementation",
    "file_size_bytes",
    "fp8_scale_renamings",
    "glob_alternation",
    "init_weights",
    "is_activation_checkpointing",
    "keep_in_fp32_strict",
    "keys_to_ignore_on_load_unexpected",
    "lora_delta_factors",
    "mark_accelerate_prepared",
    "natural_order",
    "no_split_modules",
    "parent_save_checkpoint",
    "rename_source_key",
    "revert_weight_conversion",
    "rule_class",
    "save_rng_state",
    "scheduler_file_name",
    "set_weight_conversions",
    "trainer_prepare_inputs",
    "trainer_save",
    "under_transformers_expert_parallel",
    "weight_conversions",
    "wrap_checkpointing_enable",
    "wrap_checkpointing_function",
]
