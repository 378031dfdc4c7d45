"""Padding-free batches: several examples in one row, each attending only to itself.

Two ways to get there, as in ms-swift:

* ``data.packing`` (``--packing``): examples are first grouped into *packs* of at most
  ``data.max_length`` tokens (best-fit decreasing, deterministic: the same packs for the same data);
  a pack is one dataset item, so a micro-batch holds a steady number of tokens.
* ``data.padding_free`` (``--padding_free``): every example is its own dataset item, as without
  packing, but a micro-batch is concatenated instead of padded.

Either way a micro-batch is collated by transformers' ``DataCollatorWithFlattening`` into ONE row
``[1, tokens]`` with ``position_ids`` that restart at 0 for every example and no ``attention_mask``.
transformers reads those position ids as packed sequences: its mask functions build a causal mask that
stays inside each example (sdpa, eager, flex), and flash attention gets per-example ``cu_seqlens``
(``_is_packed_sequence`` needs a batch of one row, hence one row). No mask is built here. The first
label of every example is -100, so the last token of one example does not learn to predict the next
example's first token (that label is never predicted without packing either).

Every token of such a batch is real: load-balancing counts and ``tokens_per_second`` need no mask.

Layers that carry state along the sequence (linear attention, Mamba, short convolutions) ignore
``position_ids`` and would let one example leak into the next; :func:`check_packable` refuses them
(:mod:`twinkle_strategy.sequence.packed`, shared with the transformers layer).

A later sequence-parallel split composes with this layout: it cuts the one row into contiguous
chunks and keeps the whole row's ``position_ids``.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum

import torch

# The model side (which families keep packed examples apart) is library code, shared with the transformers layer.
from twinkle_strategy.sequence import packed
from twinkle_strategy.sequence.packed import (  # noqa: F401
    PACKABLE_LAYER_TYPES,
    PackingOption,
    check_packable,
)

# A batch's token counts are the step core's (shared with every front-end); named here for the recipe's tests.
from twinkle_strategy.step import attention_length, real_token_count  # noqa: F401

# The library names packed batches; the application names the recipe keys and twinkle-sft flags that ask for them.
RECIPE_PACKING = PackingOption(name="data.packing / data.padding_free",
                               turn_off="set data.packing=false and data.padding_free=false "
                                        "(--packing false --padding_free false)")


def prepare_for_packed_batches(model: torch.nn.Module) -> None:
    """:func:`twinkle_strategy.sequence.packed.prepare_for_packed_batches`, its refusal in the recipe's words."""
    packed.prepare_for_packed_batches(model, option=RECIPE_PACKING)


class BatchLayout(str, enum.Enum):
    """How a micro-batch's examples become tensors (``data.packing`` / ``data.padding_free``)."""

    PADDED = "padded"  # one row per example, padded to the longest (attention_mask)
    PACKING = "packing"  # packs of up to max_length tokens, flattened into one row
    PADDING_FREE = "padding_free"  # one example per item, a micro-batch flattened into one row

    @classmethod
    def of(cls, *, packing: bool, padding_free: bool) -> BatchLayout:
        if packing:
            return cls.PACKING
        return cls.PADDING_FREE if padding_free else cls.PADDED

    @property
    def flattened(self) -> bool:
        return self is not BatchLayout.PADDED


Example = dict[str, list[int]]


@dataclasses.dataclass(frozen=True)
class Pack:
    """Examples trained as one unit of at most ``max_length`` tokens (one dataset item under packing)."""

    examples: tuple[Example, ...]

    def __len__(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)


def pack_examples(examples: list[Example], max_length: int) -> list[Pack]:
    """Best-fit decreasing: longest example first, into the fullest pack it still fits.

    Deterministic (ties broken by dataset order), so every rank and every resumed run builds the same
    packs. Inside a pack examples keep their dataset order. Examples are already truncated to
    ``max_length``.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]["input_ids"]), i))
    members: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, pack index), sorted: best fit = first that fits
    for i in order:
        length = len(examples[i]["input_ids"])
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            members.append([i])
            bisect.insort(free, (max_length - length, len(members) - 1))
            continue
        room, pack = free.pop(at)
        members[pack].append(i)
        bisect.insort(free, (room - length, pack))
    return [Pack(tuple(examples[i] for i in sorted(m))) for m in members]


class DataCollatorForPacking:
    """A micro-batch of examples or :class:`Pack` s -> one row: input_ids, labels, position_ids.

    transformers' ``DataCollatorWithFlattening`` does the flattening (position ids restarting at 0,
    -100 as every example's first label); this class only unpacks packs first.
    """

    def __init__(self) -> None:
        from transformers import DataCollatorWithFlattening

        self._flatten = DataCollatorWithFlattening(return_tensors="pt", return_position_ids=True)

    def __call__(self, features: list[Example | Pack]) -> dict[str, torch.Tensor]:
        examples = [e for f in features for e in (f.examples if isinstance(f, Pack) else (f,))]
        return dict(self._flatten(examples))


def describe_layout(layout: BatchLayout, items: list, *, max_length: int) -> str:
    """One log line saying how a run's batches are built (and, under packing, how full the packs are)."""
    if layout is BatchLayout.PACKING:
        examples = sum(len(p.examples) for p in items)
        fill = sum(len(p) for p in items) / max(len(items) * max_length, 1)
        return (f"data.packing: {examples} examples in {len(items)} packs of up to {max_length} tokens ({fill:.1%} "
                "full), one row per micro-batch; each example attends only to itself")
    return ("data.padding_free: each micro-batch's examples concatenated into one row without padding; each example "
            "attends only to itself")
