"""Building a model as transformers does: a concrete class from its config, one module's initialisation, the
blocks never to split (the decoder layers FSDP2 and activation checkpointing wrap).
"""

from __future__ import annotations

from torch import nn

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import CHECKED, NO_PUBLIC_API, require_on_pretrained_model

FROM_CONFIG = Internal(
    "PreTrainedModel._from_config", "transformers",
    used_for="build a concrete model class (as ms-swift passes one) from its config, in a dtype, on meta",
    checked=CHECKED,
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
    checked=CHECKED,
    replacement="none: the public initialize_weights() initialises the whole model, whose weights are on meta")


@INIT_WEIGHTS.wrapper
def init_weights(pretrained, module: nn.Module) -> None:
    """Let the transformers model ``pretrained`` initialise ``module`` (one of its modules) as it does on load."""
    INIT_WEIGHTS.attribute(pretrained, "_init_weights")(module)


NO_SPLIT_MODULES = Internal(
    "PreTrainedModel._no_split_modules", "transformers",
    used_for="find the repeated decoder layers (FSDP2 units, activation checkpointing) by their class names",
    checked=CHECKED, replacement=NO_PUBLIC_API)


@NO_SPLIT_MODULES.wrapper
def no_split_modules(module: nn.Module):
    """The class names ``module`` lists as blocks never to split (its decoder layers); empty if none."""
    require_on_pretrained_model(NO_SPLIT_MODULES, "_no_split_modules")
    return getattr(module, "_no_split_modules", None) or ()
