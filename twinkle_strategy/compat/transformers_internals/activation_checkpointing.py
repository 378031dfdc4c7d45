"""transformers' activation checkpointing: enabling it under its current name, asking whether it is on, and
making it recompute through our context_fn (the EP dispatch replayed, not sent again).
"""

from __future__ import annotations

from torch import nn

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import CHECKED

CHECKPOINTING_FUNCTION = Internal(
    "GradientCheckpointingLayer._gradient_checkpointing_func", "transformers",
    used_for="make the layers transformers checkpoints recompute through our context_fn (the EP dispatch "
             "replayed, not sent again)",
    checked=CHECKED, replacement="none: the checkpoint function is set only through the enabling call's kwargs")


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
