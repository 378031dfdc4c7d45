"""transformers' conversion rules of a model class, and which rows of a hub tensor make which rows of a model tensor.

Hub checkpoints are not laid out like the model in memory (per-expert keys where the model has one fused
tensor, renames, nesting); transformers v5 knows the rules per model class (``conversion_mapping.py``:
``WeightRenaming``, ``WeightConverter`` with ``MergeModulelist``, ``Concatenate``, ...). This module asks
transformers for the rules of the model at hand (:func:`as_transformers_classes` shows it an FSDP2-wrapped
model's own classes), tells how rows of a rule's output relate to its inputs (:class:`RowMode`), and runs a rule
on pieces exactly as ``from_pretrained`` does (:func:`convert_pieces`, :class:`Conversion`: no file needed).
Which checkpoint holds which tensor, and how rows are read and written, is
:mod:`twinkle_strategy.checkpoint.layout`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum

import torch
from torch import nn

from twinkle_strategy.compat import transformers_internals as hf
from twinkle_strategy.compat.transformers_internals import rule_class
from twinkle_strategy.dtypes import TensorSpec


class RowMode(str, enum.Enum):
    """How rows ``[a, b)`` of a model tensor are read from the checkpoint tensors it is made of."""

    ROWS = "rows"  # the same rows of every source tensor
    PER_EXPERT = "per_expert"  # experts a..b-1: their whole per-expert tensors
    WHOLE = "whole"  # the rule needs whole tensors: read whole, convert, then cut


@dataclasses.dataclass
class TensorRecipe:
    """How transformers builds one model tensor (or several, for a one-to-many rule) from checkpoint tensors."""

    transform: object  # a transformers WeightRenaming or WeightConverter, used as a template (copied per read)
    first_target: str  # the model key transformers files this rule under
    sources: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # source pattern -> checkpoint keys
    targets: dict[str, TensorSpec] = dataclasses.field(default_factory=dict)
    mode: RowMode = RowMode.WHOLE

    @property
    def per_expert(self) -> bool:
        """Rows ``[a, b)`` of the model tensor are experts ``a..b-1``, each made of whole per-expert tensors."""
        return self.mode == RowMode.PER_EXPERT

    def conversion(self) -> Conversion:
        """The rule, as a rank that has no checkpoint (only the pieces it was sent) runs it."""
        return Conversion(self.transform, self.first_target, dict(self.targets))

    @property
    def checkpoint_keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]


def conversion_rules_of(model: nn.Module):
    with as_transformers_classes(model):
        return hf.conversion_rules(model, add_legacy=True)


@contextlib.contextmanager
def as_transformers_classes(model: nn.Module):
    """Show transformers each FSDP2-sharded model with its own class while it collects the conversion rules.

    ``fully_shard`` swaps a module's class for a generated ``FSDP<Class>`` defined in a torch module, which
    transformers takes for custom code: it skips the root's rules, then applies the same rules scoped under
    the base model, where anchored patterns no longer match (Bailing-Hybrid's ``^model\\.word_embeddings\\.``
    stays unrenamed, and a save or resume of the wrapped model loses its embedding).
    """
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    swapped = []
    for module in model.modules():
        if isinstance(module, FSDPModule) and isinstance(module, PreTrainedModel):
            original = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
            swapped.append((module, type(module)))
            module.__class__ = original
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def row_mode(transform) -> RowMode:
    """How rows of dim 0 of the rule's output relate to its inputs (see the module docstring)."""
    if not isinstance(transform, rule_class("WeightConverter")):
        return RowMode.ROWS
    ops = list(transform.operations)
    mode = RowMode.ROWS
    if ops and isinstance(ops[0], rule_class("MergeModulelist")) and ops[0].dim == 0:
        mode, ops = RowMode.PER_EXPERT, ops[1:]
    # (optional: not every transformers 5.x has every operation, e.g. Split is newer than 5.19)
    along_a_dim = tuple(c for c in (rule_class(name, optional=True) for name in ("Concatenate", "Chunk", "Split",
                                                                                  "Interleave")) if c is not None)
    transpose = rule_class("Transpose")
    for op in ops:
        if isinstance(op, along_a_dim) and op.dim > 0:
            continue
        if isinstance(op, transpose) and op.dim0 > 0 and op.dim1 > 0:
            continue
        return RowMode.WHOLE
    return mode


class ShapeOnlyModel:
    """What transformers' conversion operations may ask of the model: its config and a parameter's shape.

    ``Transpose(check_dims=True)`` and ``Split`` look up the target parameter's
    shape; when we convert only rows ``[a, b)``, the parameter they must see is
    that region, so lookups answer with region-shaped meta tensors.
    """

    def __init__(self, config, shapes: dict[str, TensorSpec], rows: int | None = None):
        self.config = config
        self._shapes, self._rows = shapes, rows

    def get_parameter(self, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[name]
        if self._rows is not None and shape:
            shape = (self._rows,) + tuple(shape[1:])
        return torch.empty(shape, dtype=dtype, device="meta")


def convert_pieces(transform, first_target: str, pieces: dict[str, list[tuple[str, torch.Tensor]]], *, config,
                   shapes: dict[str, TensorSpec], rows: int | None = None
                   ) -> dict[str, torch.Tensor]:
    """Run a transformers rule (``transform``, a template: copied) on checkpoint ``pieces`` (source pattern ->
    ``(key, tensor)`` in order) exactly as from_pretrained does; ``shapes`` answers the rule's shape lookups.

    Needs no file: a rank that received the pieces (not the checkpoint) runs it too.
    """
    if isinstance(transform, rule_class("WeightRenaming")):
        ((_, tensor),) = [item for items in pieces.values() for item in items]
        return {first_target: tensor}
    transform = copy.deepcopy(transform)
    for pattern, items in pieces.items():
        for key, tensor in items:
            transform.add_tensor(first_target, key, pattern, tensor)
    shim = ShapeOnlyModel(config, shapes, rows)
    out = transform.convert(first_target, model=shim, config=config)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in out.items()}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One transformers rule with what :func:`convert_pieces` needs besides the pieces: picklable, no file."""

    transform: object  # a transformers WeightRenaming or WeightConverter, as a template
    first_target: str
    shapes: dict[str, TensorSpec]  # what the rule may look up

    def __call__(self, pieces: dict[str, list[tuple[str, torch.Tensor]]], *, config, rows: int | None = None
                 ) -> dict[str, torch.Tensor]:
        return convert_pieces(self.transform, self.first_target, pieces, config=config, shapes=self.shapes, rows=rows)
