"""Giving one module instance a behaviour by swapping its class, as FSDP2's ``fully_shard`` does.

Expert parallelism, activation checkpointing and the planner's balanced routing each change what one
module's ``forward`` does. A wrapper module holding the original as a child would add a segment to every
parameter name (``mlp.experts.gate_up_proj`` becoming ``mlp.experts.<child>.gate_up_proj``, as torch's
``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.``), and checkpoint layouts, init plans, saves, DCP
resume and PEFT adapters all key on those names. So, like ``fully_shard`` (which makes a module an
``FSDP<Class>``), :func:`swap_class` keeps the instance, its parameters and their names, and sets its
``__class__`` to a generated subclass ``(mixin, Class)``: the mixin's ``forward`` runs and reaches the
model's own through ``super().forward``. ``nn.Module.__call__`` and its hooks (FSDP2's among them) still
run around it, and ``fully_shard`` may swap the class again on top.

The generated class keeps the model class's ``__name__``: transformers (``_no_split_modules``), FSDP2's
own generated names, our decoder-layer discovery and the router rules find modules by class name, and
they must find them the same with and without the swap. ``print(model)`` shows a swap through the
mixin's ``extra_repr``; :func:`unswapped_class` gives the class whose ``forward`` is the model's own.
"""

from __future__ import annotations

from torch import nn

_SWAPPED_FROM = "_twinkle_swapped_from"  # the generated class's own attribute: the class it extends
_GENERATED: dict[tuple[type, type], type] = {}  # (mixin, class) -> generated class, one per pair


def swap_class(module: nn.Module, mixin: type[nn.Module]) -> None:
    """Make ``module`` an instance of the subclass ``(mixin, type(module))``, generated once per pair."""
    cls = type(module)
    swapped = _GENERATED.get((mixin, cls))
    if swapped is None:
        swapped = type(cls.__name__, (mixin, cls), {
            _SWAPPED_FROM: cls,
            "__module__": mixin.__module__,
            "__qualname__": f"{mixin.__qualname__}[{cls.__qualname__}]",
        })
        _GENERATED[(mixin, cls)] = swapped
    module.__class__ = swapped


def unswapped_class(cls: type) -> type:
    """The class under every :func:`swap_class` in ``cls``'s bases (an ``FSDP<Class>`` on top included).

    A class no swap generated is returned as it is: its ``forward`` is the model's own.
    """
    for base in cls.__mro__:
        original = vars(base).get(_SWAPPED_FROM)
        if original is not None:
            return unswapped_class(original)
    return cls
