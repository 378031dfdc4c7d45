"""Writing safetensors checkpoints in parallel: every rank writes only the rows it keeps, nobody gathers.

A safetensors file is a header (every tensor's dtype, shape and byte range)
followed by the tensors' bytes. Everything in the header follows from names,
shapes and dtypes, which every rank knows without a byte of weight: so every
rank computes the same file plan, one rank creates the files (header, then
the final size), and every rank writes the rows it owns at their offsets with
``os.pwrite``. Rows of dim 0 of a tensor are one contiguous byte range, and an
FSDP2 shard is rows of dim 0, so a rank's part of a tensor is one write.

A rank's part of a parameter (or of its optimizer state) is the region its
DTensor describes (:class:`~twinkle_strategy.shards.plan.Region`: its EP slice of
the experts, then FSDP's rows of that): the mirror of memory_efficient_init.
Saving turns each region into checkpoint pieces
(:meth:`CheckpointLayout.checkpoint_pieces`: for a Hugging Face checkpoint,
per-expert hub keys and renames) and writes them into the final safetensors
files at their offsets (:class:`ParallelFileWriter`). A region that is not made
of rows (PEFT's expert ``lora_B``) or a tensor that transformers' rule converts
only whole goes through one owner rank (:mod:`twinkle_strategy.shards.whole_tensors`):
no other rank holds it whole, and the report names it. Otherwise a rank sends
and receives no tensor bytes, and holds at most the piece it is writing.

Two kinds of files (read back by :mod:`twinkle_strategy.checkpoint.reading`):

* **The model as a Hugging Face checkpoint**: what ``save_pretrained`` would write for the model, in the key
  layout of the checkpoint it was loaded from (per-expert hub keys, renames, by transformers' rules reversed):
  plain ``from_pretrained``, PEFT and inference engines read them (:func:`save_model_files`).
* **Optimizer state (and trainable weights of adapter runs) by full tensor**, so any layout can resume it
  (:class:`OptimizerFiles`, :class:`TrainableFiles`). Each state tensor (AdamW's ``exp_avg``, ``exp_avg_sq``)
  is laid out like its parameter. It is saved under ``"{parameter}:{state}"`` in the parameter's full, pre-EP
  shape, every rank writing its own rows into shared safetensors files; scalars (``step``) and the
  hyper-parameters of each parameter group go to a small JSON file.

Why not torch.distributed.checkpoint's ``HuggingFaceStorageWriter`` for the model: it writes
each rank's shards into per-rank files, and its consolidation then reads them
all back and assembles every whole tensor in one process's memory before
writing the final files: twice the disk traffic, and a whole tensor (an
embedding can be gigabytes) in memory. Writing the final files directly
needs neither. And why not DCP (``get_state_dict`` + ``dcp.save``) for the optimizer: DCP
identifies a shard by the parameter's name and its DTensor's global offsets,
and with expert parallelism every EP rank's experts are a DTensor of the same
name and global shape ``[E/ep, ...]`` starting at offset 0: the EP ranks'
states would overwrite one another. Saving in full-tensor coordinates, as
the init plans them, needs no such mapping.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from twinkle_strategy.checkpoint.layout import CheckpointLayout, SameKeys
from twinkle_strategy.checkpoint.reading import INDEX_FILE, OPTIMIZER_PREFIX, SCALARS_FILE, TRAINABLE_PREFIX, IOStats
from twinkle_strategy.compat.transformers_internals import natural_order
from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.dtypes import SAFETENSORS_NAMES, TensorSpec
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import Region, partition_regions, regions_of
from twinkle_strategy.shards.whole_tensors import WholeTensors

DEFAULT_MAX_FILE_BYTES = 5 * 2**30  # transformers' default max_shard_size


@dataclasses.dataclass(frozen=True)
class PlacedTensor:
    key: str
    file: str  # file name inside the checkpoint directory
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file

    @property
    def row_bytes(self) -> int:
        if not self.shape or not self.shape[0]:
            return math.prod(self.shape) * self.dtype.itemsize
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclasses.dataclass
class FilePlan:
    """Which tensor goes where; identical on every rank for the same tensors and limit."""

    headers: dict[str, bytes]  # file name -> the bytes before the tensor data (length + JSON header)
    sizes: dict[str, int]  # file name -> total size
    tensors: dict[str, PlacedTensor]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def index(self) -> dict:
        """The content of ``model.safetensors.index.json``, as transformers writes it."""
        return {"metadata": {"total_size": sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors.values())},
                "weight_map": {key: t.file for key, t in sorted(self.tensors.items())}}


def plan_files(tensors: dict[str, TensorSpec], max_file_bytes: int,
               prefix: str = "model") -> FilePlan:
    """Assign ``tensors`` (key -> shape, dtype) to files of at most ``max_file_bytes`` (a bigger tensor gets a
    file of its own), in transformers' key order, and lay out each file's header and data."""
    groups: list[list[str]] = [[]]
    size = 0
    for key in natural_order(tensors):
        shape, dtype = tensors[key]
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    count = len(groups)
    names = [f"{prefix}.safetensors"] if count == 1 else \
        [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    headers, sizes, placed = {}, {}, {}
    for name, keys in zip(names, groups, strict=True):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key in keys:
            shape, dtype = tensors[key]
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        headers[name] = struct.pack("<Q", len(raw)) + raw
        sizes[name] = len(headers[name]) + offset
        for key in keys:
            shape, dtype = tensors[key]
            placed[key] = PlacedTensor(key, name, dtype, tuple(shape), len(headers[name]) + header[key]["data_offsets"][0])
    return FilePlan(headers, sizes, placed)


class ParallelFileWriter:
    """Writes pieces of the planned tensors into the files of ``directory``; counts what it wrote."""

    def __init__(self, directory: str, plan: FilePlan, *, create: bool = False):
        """``create``: open each file creating it (and its directory) if it does not exist yet, never truncating
        it, instead of expecting :meth:`create_files` to have made it (an asynchronous save's background writers:
        no order between ranks)."""
        self.directory, self.plan, self.create = directory, plan, create
        self._fds: dict[str, int] = {}
        self.bytes_written = 0

    def create_files(self) -> None:
        """Write every header and give every file its final size (one rank, before anyone writes)."""
        for name, header in self.plan.headers.items():
            with open(os.path.join(self.directory, name), "wb") as f:
                f.write(header)
                f.truncate(self.plan.sizes[name])

    def write_text(self, name: str, text: str) -> None:
        """A small file next to the planned ones (an index, a JSON of scalars), from text taken now."""
        with open(os.path.join(self.directory, name), "w") as f:
            f.write(text)

    def write(self, key: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Write ``tensor`` as rows ``[a, b)`` of dim 0 of tensor ``key`` (the whole tensor if None)."""
        placed = self.plan.tensors[key]
        if tensor.dtype != placed.dtype:
            raise TypeError(f"'{key}' is planned as {placed.dtype}, got {tensor.dtype}")
        expected = placed.shape if rows is None else (rows[1] - rows[0],) + placed.shape[1:]
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"'{key}' rows {rows}: expected shape {expected}, got {tuple(tensor.shape)}")
        offset = placed.begin + (rows[0] * placed.row_bytes if rows else 0)
        if tensor.numel():
            self._put(placed.file, offset, tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self.bytes_written += tensor.numel() * tensor.element_size()

    def _put(self, name: str, offset: int, data: torch.Tensor) -> None:
        """Store ``data`` (bytes, on any device) at ``offset`` of file ``name``: here, written at once."""
        write_at(self._fd(name), data.cpu().numpy(), offset)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            if self.create:
                os.makedirs(self.directory, exist_ok=True)
                self._fds[name] = os.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT, 0o644)
            else:
                self._fds[name] = os.open(os.path.join(self.directory, name), os.O_WRONLY)
        return self._fds[name]

    def finish(self) -> OSError | None:
        """Flush what this process wrote to stable storage (on a shared filesystem each writer must) and close.

        Returns the error instead of raising it: the caller reports it on every rank at its next
        fail-together check."""
        error = None
        for fd in self._fds.values():
            try:
                os.fsync(fd)
            except OSError as exc:
                error = error or exc
            os.close(fd)
        self._fds.clear()
        return error


# Makes the writer a save puts its rows through: ParallelFileWriter itself, or one that copies them into host
# memory for a background writer (twinkle_strategy.checkpoint.host_copies).
OpenWriter = Callable[[str, FilePlan], ParallelFileWriter]


def write_at(fd: int, data, offset: int) -> None:
    """All of ``data`` (a buffer) at ``offset`` of the open file ``fd`` (``pwrite`` may write less per call)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_index(writer: ParallelFileWriter, prefix: str = "model") -> None:
    """``model.safetensors.index.json`` next to several files (none for a single ``model.safetensors``), through
    ``writer`` (written now, or by an asynchronous save's background writer)."""
    plan = writer.plan
    if list(plan.headers) == [f"{prefix}.safetensors"]:
        return
    name = INDEX_FILE if prefix == "model" else f"{prefix}.safetensors.index.json"
    writer.write_text(name, json.dumps(plan.index(), indent=2))


def row_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of ``tensor`` in pieces of about ``chunk_bytes`` (at least one row)."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        yield 0, tensor
        return
    row = max(tensor[0].numel() * tensor.element_size(), 1)
    step = max(chunk_bytes // row, 1)
    for lo in range(0, tensor.shape[0], step):
        yield lo, tensor[lo:lo + step]


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

    by_rows, whole = partition_regions(regions, lambda r: r.runs is not None and layout.row_writable(key_of(r.name)))
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


def plan_model_files(model: nn.Module, ep_plan: ExpertParallelPlan | None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                     *, names: set[str] | None = None) -> tuple[CheckpointLayout, FilePlan, list]:
    """The save layout and file plan of ``model`` (the same on every rank: names, shapes and dtypes only);
    of its tensors ``names`` only, if given."""
    regions = regions_of(model, ep_plan, names)
    layout = CheckpointLayout.for_saving(model, {r.name: r.spec for r in regions})
    return layout, plan_files(layout.saved_tensors(), max_file_bytes), regions


def create_model_files(directory: str, plan: FilePlan, open_writer: OpenWriter = ParallelFileWriter) -> None:
    """Headers and final sizes of every file, and the index (one rank, before any rank writes; an asynchronous
    save's ``open_writer`` copies them for its background writer instead)."""
    writer = open_writer(directory, plan)
    writer.create_files()
    write_index(writer)


def write_model_files(directory: str, layout: CheckpointLayout, plan: FilePlan, *, regions,
                      ep_plan: ExpertParallelPlan | None, chunk_bytes: int, stats: IOStats,
                      open_writer: OpenWriter = ParallelFileWriter) -> BaseException | None:
    """This rank's rows of every tensor, into the files :func:`create_model_files` made (collective)."""
    writer = open_writer(directory, plan)
    error = write_regions(regions, layout, writer, ep_plan=ep_plan, chunk_bytes=chunk_bytes, stats=stats)
    finished = writer.finish()  # always: it closes the files
    return error or finished


def save_model_files(directory: str, model: nn.Module, *, ep_plan: ExpertParallelPlan | None, stats: IOStats, step_done,
                     max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, chunk_bytes: int = 32 * 2**20,
                     open_writer: OpenWriter = ParallelFileWriter, names: set[str] | None = None) -> None:
    """The whole collective save of ``model``'s weights (``names`` only, if given) into ``directory`` (which
    must exist).

    ``step_done(error, what)`` is the caller's fail-together check, called on every rank after each
    step: the files are created (rank 0) before any rank writes into them.
    """
    rank = global_rank()
    layout, plan, regions = plan_model_files(model, ep_plan, max_file_bytes, names=names)
    error = None
    if rank == 0:
        try:
            create_model_files(directory, plan, open_writer)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by step_done
            error = exc
    step_done(error, "model weights")
    step_done(write_model_files(directory, layout, plan, regions=regions, ep_plan=ep_plan, chunk_bytes=chunk_bytes,
                                stats=stats, open_writer=open_writer),
              "model weights")


def save_model_config(directory: str, model: nn.Module) -> None:
    """``config.json`` and ``generation_config.json`` next to the weights (one rank)."""
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)


class OptimizerFiles:
    """What a save of ``optimizer``'s state writes, planned the same way on every rank."""

    def __init__(self, model: nn.Module, optimizer, ep_plan: ExpertParallelPlan | None, max_file_bytes: int,
                 regions: list[Region] | None = None):
        """``regions``: this rank's regions of (at least) the parameters the optimizer holds state for, if the caller
        has them already (:func:`~twinkle_strategy.shards.plan.regions_of` walks the whole model)."""
        self.model, self.optimizer, self.ep_plan = model, optimizer, ep_plan
        params = self.params = dict(model.named_parameters())
        name_of = self.name_of = {id(p): n for n, p in params.items()}  # (reused by every later save of the plan)
        if regions is None:
            regions = regions_of(model, ep_plan, names={name_of[id(p)] for p in optimizer.state})
        self.regions = {r.name: r for r in regions}
        # Every rank steps the same parameters, so every rank has the same state keys.
        self.tensor_keys: dict[str, list[str]] = {}  # parameter -> its state tensors (laid out like it)
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if _laid_out_like(value, param):
                    self.tensor_keys.setdefault(name_of[id(param)], []).append(key)
        tensors = {f"{name}:{key}": TensorSpec(self.regions[name].full_shape, self._state(name, key).dtype)
                   for name, keys in self.tensor_keys.items() for key in keys}
        self.plan: FilePlan = plan_files(tensors, max_file_bytes, prefix=OPTIMIZER_PREFIX)

    def _state(self, name: str, key: str) -> torch.Tensor:
        return self.optimizer.state[self.params[name]][key]

    def scalars(self) -> dict[str, dict[str, float]]:
        """Parameter -> its state's scalars (AdamW's ``step``), as of now: the plan above stays valid from one save
        to the next, these change every step."""
        scalars: dict[str, dict[str, float]] = {}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if not _laid_out_like(value, param):
                    scalars.setdefault(self.name_of[id(param)], {})[key] = float(value)
        return scalars

    def create(self, directory: str, open_writer: OpenWriter = ParallelFileWriter) -> None:
        """Headers, sizes, index and the JSON of scalars and hyper-parameters as of now (one rank; an asynchronous
        save's ``open_writer`` copies them for its background writer)."""
        writer = open_writer(directory, self.plan)
        writer.create_files()
        write_index(writer, prefix=OPTIMIZER_PREFIX)
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [self.name_of[id(p)] for p in group["params"]]}
                  for group in self.optimizer.param_groups]
        writer.write_text(SCALARS_FILE, json.dumps({"param_groups": groups, "scalars": self.scalars()}, indent=1,
                                                   default=str))

    def write(self, directory: str, *, chunk_bytes: int, stats: IOStats,
              open_writer: OpenWriter = ParallelFileWriter) -> BaseException | None:
        """This rank's rows of every state tensor (collective).

        Every region is written (its gathers are collective) even after an error here, so no peer is
        left waiting in a gather this rank skipped; the first error is returned.
        """
        writer = open_writer(directory, self.plan)
        error = None
        by_key: dict[str, list[str]] = {}  # state key -> the parameters that have it (AdamW: all, twice)
        for name, keys in sorted(self.tensor_keys.items()):
            for key in keys:
                by_key.setdefault(key, []).append(name)
        for key, names in sorted(by_key.items()):
            # One call per state key: the tensors gathered whole (expert LoRA's lora_B) share one exchange of
            # who keeps what. Called on every rank even after this rank failed: a rank that skipped a gather
            # would leave its peers waiting in it.
            result = write_regions(
                [self.regions[name] for name in names], SameKeys(), writer, ep_plan=self.ep_plan,
                chunk_bytes=chunk_bytes, stats=stats, key_of=lambda n, key=key: f"{n}:{key}",
                local_of=lambda r, key=key: local_tensor(self._state(r.name, key)))
            error = error or result
        finished = writer.finish()  # always: it closes the files
        return error or finished


def _laid_out_like(value, param) -> bool:
    """Whether an optimizer state value is a tensor laid out like its parameter (saved by rows), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


class TrainableFiles:
    """The trainable weights of an adapter run (LoRA), by full tensor: what resume reads back on any layout."""

    def __init__(self, model: nn.Module, ep_plan: ExpertParallelPlan | None, max_file_bytes: int,
                 regions: list[Region] | None = None):
        """``regions``: this rank's regions of the trainable parameters, if the caller has them already."""
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        if regions is None:
            regions = regions_of(model, ep_plan, names=names)
        self.regions = [r for r in regions if r.name in names]
        self.ep_plan = ep_plan
        self.plan = plan_files({r.name: r.spec for r in self.regions}, max_file_bytes,
                               prefix=TRAINABLE_PREFIX)

    def create(self, directory: str, open_writer: OpenWriter = ParallelFileWriter) -> None:
        writer = open_writer(directory, self.plan)
        writer.create_files()
        write_index(writer, prefix=TRAINABLE_PREFIX)

    def write(self, directory: str, *, chunk_bytes: int, stats: IOStats,
              open_writer: OpenWriter = ParallelFileWriter) -> BaseException | None:
        writer = open_writer(directory, self.plan)
        error = write_regions(self.regions, SameKeys(), writer, ep_plan=self.ep_plan, chunk_bytes=chunk_bytes,
                              stats=stats)
        finished = writer.finish()  # always: it closes the files
        return error or finished
