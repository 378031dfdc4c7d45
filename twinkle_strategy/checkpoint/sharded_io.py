"""Every rank writes, and reads back, only the rows of each tensor it keeps: the mirror of memory_efficient_init.

A rank's part of a parameter (or of its optimizer state) is the region its
DTensor describes: its EP slice of the experts, then FSDP's rows of that
(:func:`twinkle_strategy.init.plan.needs_of`). Saving turns each region into
checkpoint pieces (:meth:`CheckpointLayout.checkpoint_pieces`: for a Hugging
Face checkpoint, per-expert hub keys and renames) and writes them into the
final safetensors files at their offsets (:class:`ParallelFileWriter`).
Loading reads the same rows back, whatever layout (nodes, ranks, ep_size)
wrote them: a file holds whole tensors, and any rows of them can be read.

A region that is not a run of rows of its full tensor (PEFT's ``lora_B`` of
experts, whose expert index varies fastest; LongCat's zero-computation
slots) or a rule that needs whole tensors is gathered (collectively, in the
same order on every rank) and written by one rank; these are small or rare,
and the report names them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import torch
from torch import nn

from twinkle_strategy.checkpoint.writer import ParallelFileWriter
from twinkle_strategy.gather import gather_full_tensor
from twinkle_strategy.init.plan import Need, checkpoint_rows, needs_of
from twinkle_strategy.runtime import global_rank


@dataclasses.dataclass
class Region:
    """One tensor this rank keeps part of: what it is, its full shape, and the local rows."""

    need: Need
    local: torch.Tensor  # this rank's rows (the DTensor's local tensor)
    value: torch.Tensor  # the model's tensor (a DTensor for parameters), for gathering
    full_shape: tuple[int, ...]  # before EP and FSDP
    rows: tuple[int, int] | None  # rows of the full tensor; None: not a run of rows (gather to write)

    @property
    def name(self) -> str:
        return self.need.name


def regions_of(model: nn.Module, ep_plan, names: set[str] | None = None) -> list[Region]:
    """This rank's regions of the model's persistent tensors (``names`` only, if given), in a fixed order."""
    values = dict(model.named_parameters())
    persistent = set(model.state_dict().keys())
    values.update({n: b for n, b in model.named_buffers() if n in persistent})
    regions = []
    for need, local in needs_of(model, ep_plan):
        if need.name not in values or (names is not None and need.name not in names):
            continue
        shape = need.shape
        if ep_plan is not None and need.name in ep_plan.axes:
            axis = ep_plan.axes[need.name]
            shape = axis.local_shape(shape, axis.num_experts)
        rows = checkpoint_rows(need, ep_plan, shape)
        if need.is_buffer:
            rows = None  # every rank has the whole buffer: one rank writes it
        regions.append(Region(need, local, values[need.name], tuple(shape), rows))
    return regions


def row_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of ``tensor`` in pieces of about ``chunk_bytes`` (at least one row)."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        yield 0, tensor
        return
    row = max(tensor[0].numel() * tensor.element_size(), 1)
    step = max(chunk_bytes // row, 1)
    for lo in range(0, tensor.shape[0], step):
        yield lo, tensor[lo:lo + step]


@dataclasses.dataclass
class IOStats:
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_received: int = 0  # tensor bytes gathered from other ranks (regions that are not runs of rows)
    gathered: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


class SameKeys:
    """The trivial layout: a tensor is saved under its own name, in its own shape (optimizer state, adapters)."""

    def row_writable(self, name: str) -> bool:
        return True

    def checkpoint_pieces(self, name, region, rows):
        return [(name, region, rows)]


def write_regions(regions: list[Region], layout, writer: ParallelFileWriter, *, ep_plan, chunk_bytes: int,
                  stats: IOStats, key_of: Callable[[str], str] = lambda name: name,
                  local_of: Callable[[Region], tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> BaseException | None:
    """Write this rank's rows of every region; returns the first write error instead of raising.

    Collective only for regions that must be gathered, and those gathers happen on every rank in the
    same order even after a write failed here (disk full...), so no peer is left waiting: the caller
    reports the error on every rank at its next fail-together check.
    ``key_of`` maps a region's name to the name ``layout`` knows it by; ``local_of`` picks other
    tensors with the region's layout (an optimizer state: its local rows, its DTensor).
    """
    start, written = time.perf_counter(), writer.bytes_written
    rank = global_rank()
    error: BaseException | None = None

    def write(name: str, tensor: torch.Tensor, rows) -> None:
        nonlocal error
        if error is not None:
            return
        try:
            for key, piece, piece_rows in layout.checkpoint_pieces(name, tensor, rows):
                writer.write(key, piece, piece_rows)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
            error = exc

    for region in regions:
        name = key_of(region.name)
        local, value = local_of(region) if local_of is not None else (region.local, region.value)
        if region.rows is not None and layout.row_writable(name):
            for lo, chunk in row_chunks(local, chunk_bytes):
                rows = (region.rows[0] + lo, region.rows[0] + lo + chunk.shape[0]) if local.dim() else None
                write(name, chunk, rows)
            continue
        # Not a run of rows, or a rule that needs the whole tensor: gathered, written by rank 0.
        if region.need.is_buffer:
            full = local
        else:
            full = gather_full_tensor(region.name, value, ep_plan)
            stats.bytes_received += full.numel() * full.element_size() - local.numel() * local.element_size()
            stats.gathered.append(name)
        if rank == 0:
            write(name, full, None)
    stats.bytes_written += writer.bytes_written - written
    stats.seconds += time.perf_counter() - start
    return error


def read_regions(regions: list[Region], read: Callable[[str, tuple[int, int] | None], torch.Tensor], *, ep_plan,
                 stats: IOStats, targets: dict[str, torch.Tensor] | None = None) -> None:
    """Fill every region's local rows (or ``targets[name]``) from ``read(name, rows)`` of the full tensor.

    (Bytes read are counted by the reader: its files know what they read.)"""
    start = time.perf_counter()
    with torch.no_grad():
        for region in regions:
            target = region.local if targets is None else targets[region.name]
            if region.rows is not None:
                value = read(region.name, region.rows)
            else:  # read whole, then cut this rank's region out (small: see the module docstring)
                from twinkle_strategy.init.plan import region_of

                value = region_of(read(region.name, None), region.need, ep_plan)
            target.copy_(value.reshape(target.shape))
    stats.seconds += time.perf_counter() - start
