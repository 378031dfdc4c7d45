"""Every rank writes, and reads back, only the rows of each tensor it keeps: the mirror of memory_efficient_init.

A rank's part of a parameter (or of its optimizer state) is the region its
DTensor describes: its EP slice of the experts, then FSDP's rows of that
(:func:`twinkle_strategy.shards.plan.needs_of`). Saving turns each region into
checkpoint pieces (:meth:`CheckpointLayout.checkpoint_pieces`: for a Hugging
Face checkpoint, per-expert hub keys and renames) and writes them into the
final safetensors files at their offsets (:class:`ParallelFileWriter`).
Loading reads the same rows back, whatever layout (nodes, ranks, ep_size)
wrote them: a file holds whole tensors, and any rows of them can be read.

A rank's region is one run of rows of the full tensor, or a few (LongCat-Flash's
zero-computation slots: two); each run is written and read as rows. A region
that is not made of rows (PEFT's expert ``lora_B``) or a tensor that
transformers' rule converts only whole goes through one owner rank
(:mod:`twinkle_strategy.shards.whole_tensors`): no other rank holds it
whole, and the report names it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from twinkle_strategy.checkpoint.writing import ParallelFileWriter
from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import Need, checkpoint_runs, needs_of
from twinkle_strategy.shards.whole_tensors import WholeTensors


@dataclasses.dataclass(eq=False)
class Region:
    """One tensor this rank keeps part of: what it is, its full shape, and the local rows."""

    need: Need
    local: torch.Tensor  # this rank's rows (the DTensor's local tensor)
    full_shape: tuple[int, ...]  # before EP and FSDP
    runs: list[tuple[int, int]] | None  # the runs of rows of the full tensor it is, in order; None: not rows

    @property
    def name(self) -> str:
        return self.need.name


def regions_of(model: nn.Module, ep_plan: ExpertParallelPlan | None, names: set[str] | None = None) -> list[Region]:
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
        runs = checkpoint_runs(need, ep_plan, shape)
        if need.is_buffer:
            runs = None  # every rank has the whole buffer: one rank writes it
        regions.append(Region(need, local, tuple(shape), runs))
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
    bytes_received: int = 0  # tensor bytes an owner received to write a tensor whole (see whole_tensors)
    gathered: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


class SameKeys:
    """The trivial layout: a tensor is saved under its own name, in its own shape (optimizer state, adapters)."""

    def row_writable(self, name: str) -> bool:
        return True

    def checkpoint_pieces(self, name, region, rows):
        return [(name, region, rows)]


def write_regions(regions: list[Region], layout, writer: ParallelFileWriter, *, ep_plan: ExpertParallelPlan | None,
                  chunk_bytes: int, stats: IOStats, key_of: Callable[[str], str] = lambda name: name,
                  local_of: Callable[[Region], torch.Tensor] | None = None) -> BaseException | None:
    """Write this rank's rows of every region; returns the first write error instead of raising.

    Collective only for tensors written whole by their owner, and those transfers happen on every rank
    in the same order even after a write failed here (disk full...), so no peer is left waiting: the
    caller reports the error on every rank at its next fail-together check.
    ``key_of`` maps a region's name to the name ``layout`` knows it by; ``local_of`` picks another
    tensor with the region's layout (an optimizer state's local rows).
    """
    start, written = time.perf_counter(), writer.bytes_written
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

    by_rows, whole = _partition(regions, lambda r: r.runs is not None and layout.row_writable(key_of(r.name)))
    for region in by_rows:
        name, local = key_of(region.name), local_of(region) if local_of is not None else region.local
        offset = 0
        for a, b in region.runs:
            for lo, chunk in row_chunks(local[offset:offset + b - a], chunk_bytes):
                write(name, chunk, (a + lo, a + lo + chunk.shape[0]))
            offset += b - a
    if whole:
        # Every rank sends its region to the tensor's owner, which writes it whole.
        locals_ = [local_of(r) if local_of is not None else r.local for r in whole]
        host_copies = getattr(writer, "host_copies", None)
        if host_copies is not None and host_copies.group is not None:
            # An asynchronous save: host copies now; the exchange (on the save's own group) and the owner's
            # writes by the background writers.
            copies = [host_copies.copy(local) for local in locals_]
            direct = ParallelFileWriter(writer.directory, writer.plan, create=True)
            stats.gathered.extend(key_of(r.name) for r in whole if not r.need.is_buffer)
            host_copies.exchange(f"the tensors written whole into {writer.directory}", functools.partial(
                _exchange_and_write, whole, copies, direct, layout, ep_plan=ep_plan, group=host_copies.group,
                key_of=key_of))
        else:
            gather_and_write(whole, locals_, ep_plan=ep_plan, stats=stats, key_of=key_of, write=write)
    stats.bytes_written += writer.bytes_written - written
    stats.seconds += time.perf_counter() - start
    return error


def gather_and_write(regions: list[Region], locals_: list[torch.Tensor], *, ep_plan: ExpertParallelPlan | None,
                     stats: IOStats, key_of: Callable[[str], str], write, group=None) -> None:
    """Each region's tensor gathered whole on its owner rank (collective on ``group``), which calls
    ``write(key, full, None)``; ``locals_[i]`` is this rank's part of ``regions[i]``."""
    table = WholeTensors([r.need for r in regions], ep_plan, group=group)
    for i, (region, local) in enumerate(zip(regions, locals_, strict=True)):
        full = table.gather(i, local)
        if full is not None:
            if not region.need.is_buffer:
                stats.bytes_received += full.numel() * full.element_size() - local.numel() * local.element_size()
                stats.gathered.append(key_of(region.name))
            write(key_of(region.name), full, None)


def _exchange_and_write(regions: list[Region], copies: list[torch.Tensor], writer: ParallelFileWriter, layout, *,
                        ep_plan: ExpertParallelPlan | None, group, key_of: Callable[[str], str]) -> None:
    """An asynchronous save's background part of :func:`write_regions` for tensors written whole: the exchange
    runs whatever happens to this rank's writes (its peers wait in it), the first write error is raised after."""
    error: BaseException | None = None

    def write(name: str, tensor: torch.Tensor, rows) -> None:
        nonlocal error
        if error is None:
            try:
                for key, piece, piece_rows in layout.checkpoint_pieces(name, tensor, rows):
                    writer.write(key, piece, piece_rows)
            except Exception as exc:  # noqa: BLE001 - raised below, once every exchange is done
                error = exc

    try:
        gather_and_write(regions, copies, ep_plan=ep_plan, stats=IOStats(), key_of=key_of, write=write, group=group)
    finally:
        finished = writer.finish()
    if error is not None or finished is not None:
        raise error or finished


def read_regions(regions: list[Region], read: Callable[[str, tuple[int, int] | None], torch.Tensor], *,
                 ep_plan: ExpertParallelPlan | None, stats: IOStats, targets: dict[str, torch.Tensor] | None = None,
                 whole: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every region's local rows (or ``targets[name]``) from ``read(name, rows)`` of the full tensor.

    A region made of rows reads just those rows. One that is not, or a tensor ``whole(name)`` says can only
    be read whole, is read once by its owner, which sends each rank its region (collective).
    (Bytes read are counted by the reader: its files know what they read.)"""
    start = time.perf_counter()
    by_rows, served = _partition(regions, lambda r: r.need.is_buffer or (r.runs is not None and not whole(r.name)))
    with torch.no_grad():
        for region in by_rows:
            target = region.local if targets is None else targets[region.name]
            if region.runs is None:  # a buffer: every rank keeps all of it
                target.copy_(read(region.name, None).reshape(target.shape))
                continue
            offset = 0
            for a, b in region.runs:
                target[offset:offset + b - a].copy_(read(region.name, (a, b)))
                offset += b - a
        if served:
            table = WholeTensors([r.need for r in served], ep_plan)
            error: BaseException | None = None
            for i, region in enumerate(served):
                target = region.local if targets is None else targets[region.name]
                full = None
                if table.owner(i) == table.rank:
                    try:
                        full = read(region.name, None)
                    except Exception as exc:  # noqa: BLE001 - raised on every rank below
                        error = error or exc
                        # Still serve every rank (zeros), so none waits for this one; all raise below.
                        full = torch.zeros(region.full_shape, dtype=target.dtype, device=target.device)
                table.scatter(i, full, target)
            raise_together(error, "reading the tensors served whole by their owner rank")
    stats.seconds += time.perf_counter() - start


def _partition(regions: list[Region], keep) -> tuple[list[Region], list[Region]]:
    """(regions ``keep`` accepts, the others), each in the original order."""
    kept, others = [], []
    for region in regions:
        (kept if keep(region) else others).append(region)
    return kept, others
