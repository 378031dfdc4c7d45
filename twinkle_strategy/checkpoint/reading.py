"""Reading safetensors checkpoints: by header and byte range, each rank only the rows it keeps.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype,
shape, byte offsets) and the raw tensor bytes. So from the headers alone we
know every tensor of a checkpoint without reading any weight, can tell a
truncated file before a byte moves, and can read rows ``[a, b)`` of a tensor as
one contiguous byte range (:class:`SafetensorsIndex`).

Why not ``safetensors.safe_open(...).get_slice``: it memory-maps the file, and
pages touched through a mapping count as resident memory of the reading
process for as long as the kernel keeps them; on a host that streams hundreds
of GB that looks (and is accounted) like holding the model. ``os.pread`` into
a buffer we own reads exactly the requested bytes, frees them with the buffer,
and lets us count every byte read.

A resume reads back what :mod:`twinkle_strategy.checkpoint.writing` wrote: each rank the rows of its own
regions (:func:`read_regions`), whatever layout (nodes, ranks, ep_size) wrote them: a file holds whole
tensors, and any rows of them can be read. The model is read through its hub layout
(:func:`read_model_files`), optimizer state and adapter weights by full tensor (:func:`read_optimizer_files`,
:func:`read_trainable_files`). A tensor that cannot be read as rows is read once by its owner rank, which
sends each rank its region (:mod:`twinkle_strategy.shards.whole_tensors`). The names of the files are defined
here, and the writer writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.checkpoint.directories import raise_if_incomplete
from twinkle_strategy.checkpoint.layout import CheckpointLayout, raise_for_problems
from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.dtypes import SAFETENSORS_DTYPES
from twinkle_strategy.errors import CheckpointError, ResumeError, shorten
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import Region, partition_regions, regions_of
from twinkle_strategy.shards.whole_tensors import WholeTensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Of a checkpoint: what resume needs beyond the saved model (optimizer state and trainable weights, by full tensor).
STATE_DIR = "trainer_state"
OPTIMIZER_PREFIX = "optimizer"
TRAINABLE_PREFIX = "trainable"
SCALARS_FILE = "optimizer.json"

_DTYPES = SAFETENSORS_DTYPES
# Every dtype the safetensors format defines (0.8): a name outside it means a corrupt header, not a new format.
_SPEC_DTYPES = set(_DTYPES) | {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"}


@dataclasses.dataclass
class IOStats:
    """What a save or a resume moved: bytes written, read, received by an owner rank, and the time taken."""

    bytes_written: int = 0
    bytes_read: int = 0
    bytes_received: int = 0  # tensor bytes an owner received to write a tensor whole (see whole_tensors)
    gathered: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0



@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one checkpoint tensor lies: its file and the absolute byte range of its data."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset of the first byte in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (the whole tensor for a 0-d tensor)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint directory ``path`` (index order), or [] if it has none."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise CheckpointError(f"{index} lists {missing[0]!r}, which does not exist in {path}"
                                  f"{f' (nor {len(missing) - 1} other files)' if len(missing) > 1 else ''}; "
                                  "the download is incomplete: download the checkpoint again")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, SINGLE_FILE)
    return [single] if os.path.isfile(single) else []


def _read_header(file: str) -> tuple[dict, int]:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"checkpoint file {file} is truncated ({size} bytes, not even a safetensors "
                                  "header); re-download or re-export it")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8:
            raise CheckpointError(f"checkpoint file {file} is truncated or not a safetensors file: its header "
                                  f"claims {length} bytes but the file has {size}; re-download or re-export it")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"checkpoint file {file} has an unreadable safetensors header ({exc}); "
                                  "re-download or re-export it") from exc
    return header, 8 + length


def _corrupt(file: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file} is corrupt: {problem}. Re-download or re-export it")


def _tensor_items(file: str, header) -> list[tuple[str, dict]]:
    if not isinstance(header, dict):
        raise _corrupt(file, f"its safetensors header is a JSON {type(header).__name__}, not an object")
    return [(key, info) for key, info in header.items() if key != "__metadata__"]


def _entry(file: str, key: str, info) -> tuple[str, torch.dtype, tuple[int, ...], int, int]:
    """One header entry as (key, dtype, shape, begin, end), offsets relative to the data section, checked as
    strictly as safetensors checks them."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise _corrupt(file, f"the header entry of tensor '{key}' is {info!r}, not {{dtype, shape, data_offsets}}")
    name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if name not in _SPEC_DTYPES:
        raise _corrupt(file, f"tensor '{key}' has dtype {name!r}, which is not a safetensors dtype "
                             f"({', '.join(sorted(_SPEC_DTYPES))})")
    if name not in _DTYPES:
        raise CheckpointError(f"tensor '{key}' in {file} has dtype {name}, which this reader does not know; "
                              "load the model in memory (stream_checkpoint=False)")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _corrupt(file, f"tensor '{key}' has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise _corrupt(file, f"tensor '{key}' has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if begin > end:
        raise _corrupt(file, f"tensor '{key}' has data_offsets [{begin}, {end}]: its end is before its begin")
    dtype = _DTYPES[name]
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise _corrupt(file, f"tensor '{key}' has {end - begin} bytes (data_offsets [{begin}, {end}]) for shape "
                             f"{tuple(shape)} of {dtype}, which needs {math.prod(shape) * dtype.itemsize}")
    return key, dtype, tuple(shape), begin, end


def _check_layout(file: str, entries: list, *, data_start: int, size: int) -> None:
    """Tensors tile the data section exactly, in offset order, as safetensors requires: no overlap, no gap."""
    position, previous = 0, None
    for key, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin < position:
            raise _corrupt(file, f"tensor '{key}' (data_offsets [{begin}, {end}]) overlaps tensor '{previous}', "
                                 f"which ends at {position}")
        if begin > position:
            raise _corrupt(file, f"bytes [{position}, {begin}) before tensor '{key}' belong to no tensor")
        position, previous = end, key
    data_size = size - data_start
    if position > data_size:
        past = sorted((e for e in entries if e[4] > data_size), key=lambda e: e[3])  # the first one cut first
        shown = shorten((f"'{e[0]}'" for e in past), 3)
        raise CheckpointError(f"checkpoint file {file} is truncated: it has {size} bytes but its tensors need "
                              f"{data_start + position}; tensor(s) {shown} lie past the end. Re-download or re-export it")
    if position < data_size:
        raise _corrupt(file, f"it has {data_size - position} bytes after its last tensor")


class SafetensorsIndex:
    """Every tensor of a safetensors checkpoint, known from the headers; reads byte ranges on demand.

    Thread-safe for reads; counts the bytes and seconds spent reading tensor data.
    """

    def __init__(self, files: list[str]):
        self.files = list(files)
        self.tensors: dict[str, StoredTensor] = {}
        self.header_bytes = 0
        for file in self.files:
            header, data_start = _read_header(file)
            self.header_bytes += data_start
            self._add_file(file, header, data_start)
        self.bytes_read = 0
        self.read_seconds = 0.0
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    @classmethod
    def from_directory(cls, path: str) -> SafetensorsIndex:
        raise_if_incomplete(path)
        files = checkpoint_files(path)
        if not files:
            raise CheckpointError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}; memory_efficient_init streams "
                                  "safetensors checkpoints (convert it with save_pretrained(safe_serialization=True))")
        return cls(files)

    def _add_file(self, file: str, header: dict, data_start: int) -> None:
        size = os.path.getsize(file)
        entries = [_entry(file, key, info) for key, info in _tensor_items(file, header)]
        _check_layout(file, entries, data_start=data_start, size=size)
        for key, dtype, shape, begin, end in entries:
            if key in self.tensors:
                raise CheckpointError(f"tensor '{key}' is stored twice, in {self.tensors[key].file} and {file}")
            self.tensors[key] = StoredTensor(key, file, dtype, shape, data_start + begin, data_start + end)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(file, os.O_RDONLY)
            return self._fds[file]

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``key`` (rows ``[a, b)`` of dim 0 only, if given), read from disk into a new CPU tensor."""
        stored = self.tensors[key]
        if rows is None or not stored.shape:
            begin, end, shape = stored.begin, stored.end, stored.shape
        else:
            a, b = rows
            if not 0 <= a <= b <= stored.shape[0]:
                raise IndexError(f"rows {rows} of '{key}' with shape {stored.shape}")
            begin, end = stored.begin + a * stored.row_bytes, stored.begin + b * stored.row_bytes
            shape = (b - a,) + stored.shape[1:]
        out = torch.empty(end - begin, dtype=torch.uint8)
        start = time.perf_counter()
        view = memoryview(out.numpy())
        done, fd = 0, self._fd(stored.file)
        while done < len(view):
            n = os.preadv(fd, [view[done:]], begin + done)
            if n == 0:
                raise CheckpointError(f"checkpoint file {stored.file} ended while reading tensor '{key}': it was "
                                      "truncated after the run started")
            done += n
        with self._lock:
            self.bytes_read += end - begin
            self.read_seconds += time.perf_counter() - start
        return out.view(stored.dtype).reshape(shape) if out.numel() else torch.empty(shape, dtype=stored.dtype)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_regions(regions: list[Region], read: Callable[[str, tuple[int, int] | None], torch.Tensor], *,
                 ep_plan: ExpertParallelPlan | None, stats: IOStats, targets: dict[str, torch.Tensor] | None = None,
                 whole: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every region's local rows (or ``targets[name]``) from ``read(name, rows)`` of the full tensor.

    A region made of rows reads just those rows. One that is not, or a tensor ``whole(name)`` says can only
    be read whole, is read once by its owner, which sends each rank its region (collective).
    (Bytes read are counted by the reader: its files know what they read.)"""
    start = time.perf_counter()
    by_rows, served = partition_regions(regions, lambda r: r.need.is_buffer or (r.runs is not None and not whole(r.name)))
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



def read_model_files(directory: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, stats: IOStats) -> None:
    """Fill this rank's shards of ``model`` from the Hugging Face checkpoint in ``directory`` (its own rows only).

    Any layout of nodes, ranks and ep_size can read what any other wrote.
    """
    regions = regions_of(model, ep_plan)
    layout = CheckpointLayout(SafetensorsIndex.from_directory(directory), model, directory,
                              model_tensors={r.name: r.spec for r in regions})
    raise_for_problems(directory, layout.problems([r.name for r in regions]))
    try:
        read_regions(regions, layout.read_rows, ep_plan=ep_plan, stats=stats,
                     whole=lambda name: not layout.row_readable(name))
        stats.bytes_read += layout.bytes_read
    finally:
        layout.close()



def read_optimizer_files(directory: str, model: nn.Module, optimizer, ep_plan: ExpertParallelPlan | None,
                         stats: IOStats) -> None:
    """Give ``optimizer`` the saved state, each rank reading the rows of its own (possibly new) shards."""
    with open(os.path.join(directory, SCALARS_FILE)) as f:
        saved = json.load(f)
    params = dict(model.named_parameters())
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ResumeError(f"{directory}: the optimizer was saved with {len(saved['param_groups'])} parameter "
                          f"groups, this one has {len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        missing = sorted(set(saved_group["params"]) - set(params))
        if missing:
            raise ResumeError(f"{directory}: optimizer state of parameter '{missing[0]}', which this model does "
                              "not have; resume with the model the checkpoint was trained from")
        # The saved hyper-parameters, not how it ran: the implementation is this optimizer's (a run saved with
        # fused AdamW resumes with foreach, or back; their state is the same).
        group.update({k: v for k, v in saved_group.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
    on_device = _steps_on_device(optimizer)
    files = _optimizer_files(directory)
    index = SafetensorsIndex(files) if files else None
    regions = {r.name: r for r in regions_of(model, ep_plan, names=set(params))}
    tensor_keys: dict[str, list[str]] = {}
    for key in (index.tensors if index is not None else {}):
        name, _, state = key.rpartition(":")
        tensor_keys.setdefault(name, []).append(state)
    try:
        for name in sorted(set(tensor_keys) | set(saved["scalars"])):
            param = params[name]
            state = {k: _scalar(k, v, param, id(param) in on_device) for k, v in saved["scalars"].get(name, {}).items()}
            for key in tensor_keys.get(name, []):
                local = torch.empty_like(local_tensor(param))
                read_regions([regions[name]], lambda n, rows, key=key: index.read(f"{n}:{key}", rows),
                             ep_plan=ep_plan, stats=stats, targets={name: local})
                state[key] = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                                stride=param.stride()) if isinstance(param, DTensor) else local
            optimizer.state[param] = state
    finally:
        if index is not None:
            stats.bytes_read += index.bytes_read
            index.close()


# Optimizer options that say how it computes, not what: torch.optim's implementation flags.
IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _steps_on_device(optimizer) -> set[int]:
    """The ids of the parameters whose ``step`` the optimizer keeps on their device: those of fused and capturable
    groups, as ``torch.optim.Optimizer.load_state_dict`` puts it (the others keep it on the CPU)."""
    return {id(p) for group in optimizer.param_groups if group.get("fused") or group.get("capturable")
            for p in group["params"]}


def _scalar(key: str, value: float, param, on_device: bool) -> torch.Tensor:
    if key == "step" and on_device:
        return torch.tensor(value, dtype=torch.float32, device=local_tensor(param).device)
    return torch.tensor(value)


def _optimizer_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if f.startswith(OPTIMIZER_PREFIX) and f.endswith(".safetensors"))


def read_trainable_files(directory: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, stats: IOStats) -> None:
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory)
                   if f.startswith(TRAINABLE_PREFIX) and f.endswith(".safetensors"))
    index = SafetensorsIndex(files)
    try:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        missing = sorted(names - set(index.tensors))
        if missing:
            raise ResumeError(f"{directory} has no saved weights for trainable parameter '{missing[0]}' (nor "
                              f"{len(missing) - 1} others); resume with the adapter configuration it was saved with")
        read_regions(regions_of(model, ep_plan, names=names), index.read, ep_plan=ep_plan, stats=stats)
        stats.bytes_read += index.bytes_read
    finally:
        index.close()


def read_trainable_state(state_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The trainable weights saved in ``state_dir`` (``trainer_state/``), whole, in the order of ``names``."""
    files = sorted(os.path.join(state_dir, f) for f in os.listdir(state_dir)
                   if f.startswith(TRAINABLE_PREFIX) and f.endswith(".safetensors"))
    index = SafetensorsIndex(files)
    try:
        return {name: index.read(name, None) for name in names}
    finally:
        index.close()
