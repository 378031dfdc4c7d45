"""Which rank assembles which rows of which tensor, in which bucket: pure arithmetic, no process group.

An export is a list of buckets, the same on every rank. A bucket goes to one destination rank (the receiver,
or the trainer rank that feeds one engine rank) and holds items: a tensor whole, or for a tensor the hub
stores per expert, a run of whole experts (rows of the fused tensor). A bucket's items add up to at most
``bucket_bytes`` unless one item alone is larger (a tensor the engine needs whole: an embedding).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from twinkle_strategy.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """What planning needs to know of one exported tensor."""

    shape: tuple[int, ...]  # before EP and FSDP
    dtype: torch.dtype  # as sent
    by_experts: bool  # rows of dim 0 are experts, each its own checkpoint keys: may be cut between buckets
    experts: int = 0  # how many experts dim 0 holds (by_experts tensors and EngineExperts' expert tensors)
    name: str = ""  # for messages

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Item:
    tensor: int  # index of the tensor in the export
    rows: tuple[int, int] | None  # rows of dim 0 of the full tensor; None: all of it
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    index: int
    dest: int  # the global rank that assembles it
    items: tuple[Item, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


@dataclasses.dataclass(frozen=True)
class OneReceiver:
    """Every tensor reaches trainer rank ``rank``, which hands each bucket to the engine (or to a process
    outside the group)."""

    rank: int = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


@dataclasses.dataclass(frozen=True)
class EngineExperts:
    """An expert-parallel engine: engine rank ``j`` serves experts ``[j * E / n, (j + 1) * E / n)`` of every
    MoE layer and is fed by trainer rank ``ranks[j]``, which receives those experts and every non-expert tensor."""

    ranks: tuple[int, ...]

    def __post_init__(self):
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ArgumentError(f"EngineExperts(ranks={self.ranks}) needs one distinct trainer rank per engine rank")


def _rows_bytes(spec: TensorPlan, rows: tuple[int, int] | None) -> int:
    if rows is None:
        return math.prod(spec.shape) * spec.dtype.itemsize
    return (rows[1] - rows[0]) * spec.row_bytes


def _experts_range(spec: TensorPlan, j: int, n: int) -> tuple[int, int]:
    per = spec.experts // n
    return j * per, (j + 1) * per


def _expert_chunks(spec: TensorPlan, lo: int, hi: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` in runs of whole experts of at most ``bucket_bytes`` (at least one expert)."""
    step = max(bucket_bytes // max(spec.row_bytes, 1), 1)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def plan_items(specs: list[TensorPlan], *, bucket_bytes: int, receivers: OneReceiver | EngineExperts,
               expert_tensors: set[int] = frozenset()) -> dict[int, list[Item]]:
    """Destination rank -> its items, in export order. ``expert_tensors``: tensors EngineExperts splits by engine
    rank (each must be ``by_experts`` with a number of experts the engine ranks divide)."""
    out: dict[int, list[Item]] = {rank: [] for rank in receivers.ranks}
    n = len(receivers.ranks)
    for i, spec in enumerate(specs):
        for j, dest in enumerate(receivers.ranks):
            if i in expert_tensors and isinstance(receivers, EngineExperts):
                if not spec.by_experts or spec.experts % n:
                    why = ("its checkpoint stores the experts fused, not per expert" if not spec.by_experts
                           else f"its {spec.experts} experts do not divide over {n} engine ranks")
                    raise ArgumentError(f"EngineExperts cannot give each of {n} engine ranks its experts of tensor "
                                     f"'{spec.name or i}' {spec.shape}: {why}; use OneReceiver and let the engine "
                                     "cut the experts")
                lo, hi = _experts_range(spec, j, n)
            elif spec.by_experts:
                lo, hi = 0, spec.shape[0]
            else:
                out[dest].append(Item(i, None, _rows_bytes(spec, None)))
                continue
            out[dest] += [Item(i, rows, _rows_bytes(spec, rows)) for rows in _expert_chunks(spec, lo, hi, bucket_bytes)]
    return out


def plan_buckets(items: dict[int, list[Item]], bucket_bytes: int) -> list[BucketPlan]:
    """Items packed in order into buckets of at most ``bucket_bytes`` (one larger item: a bucket of its own);
    the destinations take turns, so that several engine ranks fill at once."""
    per_dest: dict[int, list[list[Item]]] = {}
    for dest, dest_items in items.items():
        buckets: list[list[Item]] = []
        size = 0
        for item in dest_items:
            if not buckets or size + item.nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += item.nbytes
        per_dest[dest] = buckets
    out: list[BucketPlan] = []
    for turn in range(max((len(b) for b in per_dest.values()), default=0)):
        for dest, buckets in per_dest.items():
            if turn < len(buckets):
                out.append(BucketPlan(len(out), dest, tuple(buckets[turn])))
    return out


def overlaps(runs: list[tuple[int, int]], rows: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Where rows ``[a, b)`` of a full tensor lie in a region made of ``runs`` (rows of the full tensor, in the
    region's order): ``(offset in the region, offset in [a, b), row count)`` for each overlap."""
    a, b = rows
    out, offset = [], 0
    for lo, hi in runs:
        first, last = max(lo, a), min(hi, b)
        if first < last:
            out.append((offset + first - lo, first - a, last - first))
        offset += hi - lo
    return out
