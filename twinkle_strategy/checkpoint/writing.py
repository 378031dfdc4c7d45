"""Safetensors files written by many processes at once, each writing only its own bytes.

A safetensors file is a header (every tensor's dtype, shape and byte range)
followed by the tensors' bytes. Everything in the header follows from names,
shapes and dtypes, which every rank knows without a byte of weight: so every
rank computes the same file plan, one rank creates the files (header, then
the final size), and every rank writes the rows it owns at their offsets with
``os.pwrite``. Rows of dim 0 of a tensor are one contiguous byte range, and an
FSDP2 shard is rows of dim 0, so a rank's part of a tensor is one write.

Nobody gathers anything: a rank sends and receives no tensor bytes, and holds
at most the piece it is writing.

Why not torch.distributed.checkpoint's ``HuggingFaceStorageWriter``: it writes
each rank's shards into per-rank files, and its consolidation then reads them
all back and assembles every whole tensor in one process's memory before
writing the final files: twice the disk traffic, and a whole tensor (an
embedding can be gigabytes) in memory. Writing the final files directly
needs neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable

import torch

from twinkle_strategy.checkpoint.reading import DTYPE_NAMES, INDEX_FILE
from twinkle_strategy.compat.transformers_internals import natural_order
from twinkle_strategy.dtypes import TensorSpec


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
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
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
