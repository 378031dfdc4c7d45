"""How a model's tensors are made from a hub checkpoint's tensors, and how to read any rows of one.

Hub checkpoints are not laid out like the model in memory: Mixtral stores
``block_sparse_moe.experts.3.w1.weight`` per expert where the model has one
fused ``mlp.experts.gate_up_proj [E, 2I, H]``, DeepSeek-V4 renames most keys,
Qwen3.5-MoE as released nests the text model under ``model.language_model.``.
transformers v5 knows these rules per model class (``conversion_mapping.py``:
``WeightRenaming``, ``WeightConverter`` with ``MergeModulelist``,
``Concatenate``, ...). This module asks transformers for the rules of the
model at hand and applies them exactly as ``from_pretrained`` does, with one
difference: it never loads a whole tensor when it can avoid it.

FSDP2 shards every parameter on dim 0, and the expert dim of a fused expert
tensor is dim 0, so what a rank keeps is always rows ``[a, b)`` of a model
tensor. For most conversions those rows come from rows of the checkpoint
tensors:

* a renamed tensor: the same rows of the checkpoint tensor;
* ``MergeModulelist(dim=0)`` (per-expert keys stacked into one tensor) followed
  by operations that leave dim 0 alone (``Concatenate(dim=1)``,
  ``Transpose(1, 2)``, ...): rows ``[a, b)`` are experts ``a..b-1``, i.e. the
  per-expert checkpoint tensors of those experts only;
* operations that leave dim 0 alone on their own: rows ``[a, b)`` of every
  source tensor.

Anything else (e.g. a ``Concatenate(dim=0)`` fusing q/k/v) is read whole,
converted, then cut; :attr:`CheckpointLayout.materialized_whole` lists those
tensors so the init report can say so. The knowledge of key layouts lives here
and nowhere else (saving uses the same rules in reverse).

A layout reads through a :class:`CheckpointIndex` (files on disk, a quantized release, or the tensors a save
declares); :class:`SameKeys` is the trivial layout, a tensor saved under its own name (optimizer state, adapters).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from twinkle_strategy.checkpoint.conversions import (
    RowMode,
    ShapeOnlyModel,
    TensorRecipe,
    as_transformers_classes,
    conversion_rules_of,
    convert_pieces,
    row_mode,
)
from twinkle_strategy.compat import transformers_internals as hf
from twinkle_strategy.compat.transformers_internals import rule_class
from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.errors import CheckpointError, shorten

logger = logging.getLogger(__name__)


class TensorHeader(Protocol):
    """What a checkpoint index knows of one tensor without reading it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@runtime_checkable
class CheckpointIndex(Protocol):
    """A checkpoint's tensors by name, as :class:`CheckpointLayout` reads them.

    Three kinds: :class:`~twinkle_strategy.checkpoint.reading.SafetensorsIndex` (files on disk), ``QuantizedIndex``
    (a quantized release seen as its dequantized values) and :class:`DeclaredTensors` (the checkpoint a save is
    about to write: headers only).
    """

    tensors: Mapping[str, TensorHeader]

    @property
    def bytes_read(self) -> int: ...  # tensor data read so far

    @property
    def read_seconds(self) -> float: ...

    def __contains__(self, key: str) -> bool: ...

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``key`` (rows ``[a, b)`` of dim 0 only, if given) as a new CPU tensor."""
        ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason a checkpoint does not fit the model, as the error words it."""

    message: str
    tensor: str | None = None  # the model tensor it is about; None: the checkpoint as a whole

    def __str__(self) -> str:
        return self.message


class CheckpointLayout:
    """The model tensors a safetensors checkpoint provides, by transformers' rules for ``model``'s class.

    Built from a model whose tensors have their final names and shapes (any
    device: meta, placeholders) and from the checkpoint's headers; reads no
    weight. :meth:`problems` lists what does not fit; :meth:`read_rows` reads
    rows of a model tensor.
    """

    def __init__(self, index: CheckpointIndex, model: nn.Module, path: str = "",
                 model_tensors: dict[str, TensorSpec] | None = None):
        """``model_tensors`` (name -> shape, dtype) overrides the model's own, e.g. the pre-EP shapes of a
        model whose experts are already cut."""
        renaming, converter = rule_class("WeightRenaming"), rule_class("WeightConverter")
        self.index, self.path = index, path
        self.config = model.config
        self.model_tensors: dict[str, TensorSpec] = model_tensors or {
            k: TensorSpec.of(v) for k, v in model.state_dict(keep_vars=True).items()}
        self.ignored_unexpected = [re.compile(p) for p in hf.keys_to_ignore_on_load_unexpected(model)]
        rules = conversion_rules_of(model)
        renamings = [r for r in rules if isinstance(r, renaming)]
        converters = [r for r in rules if isinstance(r, converter)]
        converter_of = {pattern: conv for conv in converters for pattern in conv.source_patterns}
        # Keys are matched in transformers' order: converters collect per-expert tensors in list order.
        recipes: dict[str, TensorRecipe] = {}
        self.unexpected: list[str] = []
        present = self.model_tensors
        for key in hf.natural_order(index.tensors):
            target, pattern = hf.rename_source_key(key, renamings, converters, model.base_model_prefix, present)
            if target not in present and key in present:  # as transformers: the key was fine as it was
                target, pattern = key, None
            if target not in present:
                self.unexpected.append(key)
                continue
            if pattern is None:
                recipe = recipes.setdefault(target, TensorRecipe(renaming(key, target), target))
                pattern = key
            else:
                recipe = recipes.setdefault(target, TensorRecipe(converter_of[pattern], target))
            recipe.sources.setdefault(pattern, []).append(key)
        # The rules that matched, kept for saving in the checkpoint's own layout.
        self.rules = [r for r in rules if r.was_used()]
        self.recipes: dict[str, TensorRecipe] = {}  # every model key a recipe produces -> its recipe
        self._problems: list[Problem] = []
        for recipe in recipes.values():
            self._plan(recipe)
        self.materialized_whole: set[str] = set()

    # ------------------------------------------------------------------ planning
    def _meta_sources(self, recipe: TensorRecipe) -> dict[str, list[torch.Tensor]]:
        out = {}
        for pattern, keys in recipe.sources.items():
            out[pattern] = [torch.empty(self.index.tensors[k].shape, dtype=self.index.tensors[k].dtype,
                                        device="meta") for k in keys]
        return out

    def _convert(self, recipe: TensorRecipe, tensors: dict[str, list[torch.Tensor]], rows: int | None = None
                 ) -> dict[str, torch.Tensor]:
        """Run the rule on ``tensors`` (per source pattern, in order) exactly as from_pretrained does."""
        keyed = {p: list(zip(recipe.sources[p], pieces, strict=False)) for p, pieces in tensors.items()}
        return convert_pieces(recipe.transform, recipe.first_target, keyed, config=self.config,
                              shapes=self.model_tensors, rows=rows)

    def _plan(self, recipe: TensorRecipe) -> None:
        # 1. Pieces merged into one tensor must agree (a wrong-shaped expert is named here, by its key).
        for keys in recipe.sources.values():
            shapes = [self.index.tensors[k].shape for k in keys]
            common = max(set(shapes), key=shapes.count)
            odd = [k for k, s in zip(keys, shapes, strict=True) if s != common]
            if odd:
                target_shape = self.model_tensors[recipe.first_target].shape
                for key in odd[:3]:
                    self._problems.append(Problem(
                        f"checkpoint tensor '{key}' has shape {self.index.tensors[key].shape} but the "
                        f"{len(keys) - len(odd)} other tensors that form model parameter '{recipe.first_target}' "
                        f"{target_shape} have {common}", recipe.first_target))
                return
        # 2. What the rule produces, computed on meta tensors: names and shapes, no bytes read.
        try:
            produced = self._convert(recipe, self._meta_sources(recipe))
        except Exception as exc:  # noqa: BLE001 - transformers' conversion rejected the pieces
            self._problems.append(self._diagnose(recipe, recipe.first_target, f"{type(exc).__name__}: {exc}"))
            return
        for name, value in produced.items():
            if name not in self.model_tensors:
                continue
            if tuple(value.shape) != self.model_tensors[name].shape:
                self._problems.append(self._diagnose(recipe, name, f"they give shape {tuple(value.shape)}"))
                continue
            recipe.targets[name] = self.model_tensors[name]
            self.recipes[name] = recipe
        recipe.mode = row_mode(recipe.transform)
        if recipe.mode == RowMode.PER_EXPERT and any(len(keys) != spec.shape[0] for keys in recipe.sources.values()
                                                     for spec in recipe.targets.values()):
            recipe.mode = RowMode.WHOLE

    def _diagnose(self, recipe: TensorRecipe, name: str, failure: str) -> Problem:
        """Name what is wrong with the checkpoint tensors of model tensor ``name``: missing keys, else shapes."""
        return Problem(self._diagnosis(recipe, name, failure), name)

    def _diagnosis(self, recipe: TensorRecipe, name: str, failure: str) -> str:
        want = self.model_tensors[name].shape
        keys = recipe.checkpoint_keys
        missing = [k for k in (self.expected_checkpoint_keys(name) or {}) if k not in self.index]
        if missing:
            shown = shorten((f"'{k}'" for k in missing), 4)
            return f"model parameter '{name}' {want} needs checkpoint tensor(s) {shown}, which are missing"
        if len(keys) == 1:
            got = self.index.tensors[keys[0]].shape
            return (f"tensor '{name}' has shape {got} in the checkpoint but the model expects {want}"
                    + (f" (checkpoint key '{keys[0]}')" if keys[0] != name else ""))
        return (f"model parameter '{name}' expects shape {want} but cannot be made from checkpoint tensors "
                f"{shorten((repr(k) for k in keys), 3)}: {failure}")

    def expected_checkpoint_keys(self, name: str, shape: tuple | None = None) -> dict[str, tuple] | None:
        """The checkpoint keys (and shapes) that model tensor ``name`` is saved as, by the reverse rules."""
        spec = self.model_tensors.get(name)
        if spec is None:
            return None
        shape = shape or spec.shape
        shapes = ShapeOnlyModel(self.config, self.model_tensors)
        try:
            out = hf.revert_weight_conversion(self.rules, self.config, shapes.get_parameter,
                                              {name: torch.empty(shape, dtype=spec.dtype, device="meta")})
        except Exception:  # noqa: BLE001 - only used to word an error message better
            return None
        return {k: tuple(v.shape) for k, v in out.items()}

    def problems(self, required: list[str]) -> list[Problem]:
        """Why this checkpoint cannot provide the model tensors ``required``: wrong shapes, missing keys."""
        found = list(self._problems)
        named = {p.tensor for p in self._problems}
        for name in required:
            if name in self.recipes or name in named:
                continue
            expected = self.expected_checkpoint_keys(name)
            keys = [k for k in (expected or {}) if k != name]
            found.append(Problem(f"tensor '{name}' is missing from the checkpoint"
                                 + (f" (checkpoint key {', '.join(repr(k) for k in keys[:2])})" if keys else ""), name))
        return found

    def unexpected_keys(self) -> list[str]:
        """Checkpoint keys no model tensor is made from (minus those the model class says to ignore)."""
        return [k for k in self.unexpected if not any(p.search(k) for p in self.ignored_unexpected)]

    # ------------------------------------------------------------------ reading
    def read_rows(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` of dim 0 of model tensor ``name`` (all of it if None), in the model's dtype."""
        recipe = self.recipes[name]
        shape, dtype = recipe.targets[name]
        if rows is not None and not shape:
            rows = None
        mode = recipe.mode if rows is not None else RowMode.WHOLE
        if mode == RowMode.WHOLE and rows is not None:
            self.materialized_whole.add(name)
        if rows is not None and rows[0] == rows[1]:
            return torch.empty((0,) + tuple(shape[1:]), dtype=dtype)
        if mode == RowMode.PER_EXPERT:
            a, b = rows
            pieces = {p: [self._read(k, None, dtype) for k in keys[a:b]] for p, keys in recipe.sources.items()}
        else:
            pieces = {p: [self._read(k, rows if mode == RowMode.ROWS else None, dtype) for k in keys]
                      for p, keys in recipe.sources.items()}
        out = self._convert(recipe, pieces, rows=(rows[1] - rows[0]) if mode != RowMode.WHOLE and rows else None)[name]
        if mode == RowMode.WHOLE and rows is not None:
            out = out[rows[0]:rows[1]]
        return out.to(dtype).contiguous()

    def _read(self, key: str, rows, dtype: torch.dtype) -> torch.Tensor:
        # Cast each piece at once, as from_pretrained does (so the converted tensor is built in the model's dtype).
        return self.index.read(key, rows).to(dtype)

    @property
    def bytes_read(self) -> int:
        return self.index.bytes_read

    def close(self) -> None:
        self.index.close()

    # ------------------------------------------------------------------ writing (the same rules, reversed)
    @classmethod
    def for_saving(cls, model: nn.Module, model_tensors: dict[str, TensorSpec]) -> CheckpointLayout:
        """The checkpoint ``model`` is saved as: transformers' rules reversed, as ``save_pretrained`` applies them.

        The rules are those that matched when the model was loaded (so a checkpoint comes back in its own
        layout), else the model class's own. Needs no file: names, shapes and dtypes only.
        """
        rules = hf.weight_conversions(model)
        if rules is None:
            # As transformers does for a model not loaded by from_pretrained: no prefix it cannot know of.
            with as_transformers_classes(model):
                rules = [r for r in hf.conversion_rules(model, add_legacy=False)
                         if not isinstance(r, rule_class("PrefixChange"))]
        shapes = ShapeOnlyModel(model.config, model_tensors)
        saved = hf.revert_weight_conversion(rules, model.config, shapes.get_parameter,
                                            {name: torch.empty(shape, dtype=dtype, device="meta")
                                             for name, (shape, dtype) in model_tensors.items()})
        layout = cls(DeclaredTensors({k: TensorSpec.of(v) for k, v in saved.items()}), model,
                     model_tensors=model_tensors)
        lost = sorted(set(model_tensors) - set(layout.recipes))
        if layout._problems or lost:
            why = shorten(layout._problems, 3, "; ") or f"no checkpoint tensor is made of {shorten(lost, 3)}"
            raise CheckpointError(f"cannot save {type(model).__name__} in the layout transformers' rules give it: "
                                  f"{why}")
        return layout

    def saved_tensors(self) -> dict[str, TensorSpec]:
        """Checkpoint key -> shape and dtype, of every tensor a save writes."""
        return {key: TensorSpec.of(t) for key, t in self.index.tensors.items()}

    def row_readable(self, name: str) -> bool:
        """Whether rows of model tensor ``name`` are read as rows (else the rule needs the whole tensor)."""
        return self.recipes[name].mode != RowMode.WHOLE

    def row_writable(self, name: str) -> bool:
        """Whether rows of model tensor ``name`` map to rows (or whole pieces) of checkpoint tensors."""
        recipe = self.recipes[name]
        return recipe.mode != RowMode.WHOLE and len(recipe.targets) == 1

    def checkpoint_pieces(self, name: str, region: torch.Tensor, rows: tuple[int, int] | None
                          ) -> list[tuple[str, torch.Tensor, tuple[int, int] | None]]:
        """Model tensor ``name``'s rows ``[a, b)`` (``region``; all of it if ``rows`` is None) as what a save
        writes: ``(checkpoint key, tensor, its rows or None for the whole checkpoint tensor)``.

        The reverse of :meth:`read_rows`: transformers' reversed operations run on the region; for
        per-expert keys, row ``i`` of the region is expert ``a + i``, written whole under its own key.
        """
        recipe = self.recipes[name]
        whole = rows is None  # then every piece is a whole checkpoint tensor
        if rows is None or not self.row_writable(name):
            if rows is not None:
                raise ValueError(f"'{name}' is saved by a rule that needs the whole tensor, not rows {rows}")
            rows = (0, region.shape[0]) if region.dim() else None
        if isinstance(recipe.transform, rule_class("WeightRenaming")):
            (key,) = recipe.checkpoint_keys
            return [(key, region, rows)]
        forward = recipe.transform
        backward = forward.reverse_transform()
        # The reversed rule's targets are the forward rule's sources, in the same order.
        source_of = dict(zip(backward.target_patterns, forward.source_patterns, strict=False))
        ops = list(backward.operations)
        per_expert = recipe.mode == RowMode.PER_EXPERT and ops and isinstance(ops[-1], rule_class("SplitModulelist"))
        if per_expert:
            ops = ops[:-1]  # split the experts here, so each gets its own checkpoint key (expert a + i)
        collected: dict = {backward.source_patterns[0]: [region]}
        shim = ShapeOnlyModel(self.config, self.model_tensors, None if rows is None else rows[1] - rows[0])
        for op in ops:
            collected = op.convert(collected, source_patterns=backward.source_patterns,
                                   target_patterns=backward.target_patterns, full_layer_name=name, model=shim,
                                   config=self.config)
        pieces = []
        for pattern, value in collected.items():
            value = value[0] if isinstance(value, list) else value
            forward_pattern = source_of.get(pattern) or next(iter(recipe.sources))
            keys = recipe.sources[forward_pattern]
            if per_expert:
                start = rows[0] if rows is not None else 0
                pieces += [(keys[start + i], value[i], None) for i in range(value.shape[0])]
            else:
                (key,) = keys
                pieces.append((key, value, None if whole else rows))
        return pieces


class SameKeys:
    """The trivial layout: a tensor is saved under its own name, in its own shape (optimizer state, adapters)."""

    def row_writable(self, name: str) -> bool:
        return True

    def checkpoint_pieces(self, name, region, rows):
        return [(name, region, rows)]


class DeclaredTensors:
    """A checkpoint known by its tensors' names, shapes and dtypes only: the one a save is about to write.

    A :class:`CheckpointIndex` with nothing to read yet.
    """

    def __init__(self, tensors: dict[str, TensorSpec]):
        self.tensors = {k: TensorSpec(tuple(shape), dtype) for k, (shape, dtype) in tensors.items()}
        self.bytes_read, self.read_seconds = 0, 0.0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise CheckpointError(f"tensor '{key}' is declared for a save, not written yet: there is nothing to read")

    def close(self) -> None:
        pass


def raise_for_problems(path: str, problems: list[Problem]) -> None:
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config.json: {shorten(problems, 5, '; ')}. "
                              "Re-export the checkpoint, or fix config.json so the shapes agree")
