"""The tensors of a save as safetensors files, written by every rank in parallel and read back per rank.

Two kinds of files, each rank writing the rows it keeps (no rank gathers the model:
:mod:`twinkle_strategy.checkpoint.sharded_io`):

* **The model as a Hugging Face checkpoint**: what ``save_pretrained`` would write for the model, in the key
  layout of the checkpoint it was loaded from (per-expert hub keys, renames, by transformers' rules reversed):
  plain ``from_pretrained``, PEFT and inference engines read them.
* **Optimizer state (and trainable weights of adapter runs) by full tensor**, so any layout can resume it.
  Each state tensor (AdamW's ``exp_avg``, ``exp_avg_sq``) is laid out like its parameter. It is saved under
  ``"{parameter}:{state}"`` in the parameter's full, pre-EP shape, every rank writing its own rows into shared
  safetensors files; scalars (``step``) and the hyper-parameters of each parameter group go to a small JSON
  file. Resuming with other nodes, ranks or ep_size then only reads, on each rank, the rows its new shards cover.

Why not torch.distributed.checkpoint (``get_state_dict`` + ``dcp.save``) for the optimizer: DCP
identifies a shard by the parameter's name and its DTensor's global offsets,
and with expert parallelism every EP rank's experts are a DTensor of the same
name and global shape ``[E/ep, ...]`` starting at offset 0: the EP ranks'
states would overwrite one another. Saving in full-tensor coordinates, as
the init plans them, needs no such mapping.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.checkpoint.files import SafetensorsIndex
from twinkle_strategy.checkpoint.layout import CheckpointLayout, raise_for_problems
from twinkle_strategy.checkpoint.sharded_io import (
    IOStats,
    Region,
    SameKeys,
    read_regions,
    regions_of,
    write_regions,
)
from twinkle_strategy.checkpoint.writer import FilePlan, OpenWriter, ParallelFileWriter, plan_files, write_index
from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.errors import ResumeError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan

DEFAULT_MAX_FILE_BYTES = 5 * 2**30  # transformers' default max_shard_size


def _model_tensors(regions) -> dict[str, TensorSpec]:
    return {r.name: TensorSpec(r.full_shape, r.need.dtype) for r in regions}


def plan_model_files(model: nn.Module, ep_plan: ExpertParallelPlan | None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                     *, names: set[str] | None = None) -> tuple[CheckpointLayout, FilePlan, list]:
    """The save layout and file plan of ``model`` (the same on every rank: names, shapes and dtypes only);
    of its tensors ``names`` only, if given."""
    regions = regions_of(model, ep_plan, names)
    layout = CheckpointLayout.for_saving(model, _model_tensors(regions))
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


def read_model_files(directory: str, model: nn.Module, ep_plan: ExpertParallelPlan | None, stats: IOStats) -> None:
    """Fill this rank's shards of ``model`` from the Hugging Face checkpoint in ``directory`` (its own rows only).

    Any layout of nodes, ranks and ep_size can read what any other wrote.
    """
    regions = regions_of(model, ep_plan)
    layout = CheckpointLayout(SafetensorsIndex.from_directory(directory), model, directory,
                              model_tensors=_model_tensors(regions))
    raise_for_problems(directory, layout.problems([r.name for r in regions]))
    try:
        read_regions(regions, layout.read_rows, ep_plan=ep_plan, stats=stats,
                     whole=lambda name: not layout.row_readable(name))
        stats.bytes_read += layout.bytes_read
    finally:
        layout.close()


# -- optimizer state and trainable weights, by full tensor
STATE_DIR = "trainer_state"  # of a checkpoint: what resume needs beyond the saved model
OPTIMIZER_PREFIX = "optimizer"
TRAINABLE_PREFIX = "trainable"
SCALARS_FILE = "optimizer.json"


class OptimizerFiles:
    """What a save of ``optimizer``'s state writes, planned the same way on every rank."""

    def __init__(self, model: nn.Module, optimizer, ep_plan: ExpertParallelPlan | None, max_file_bytes: int,
                 regions: list[Region] | None = None):
        """``regions``: this rank's regions of (at least) the parameters the optimizer holds state for, if the caller
        has them already (:func:`~twinkle_strategy.checkpoint.sharded_io.regions_of` walks the whole model)."""
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
    files = _files(directory)
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


def _files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if f.startswith(OPTIMIZER_PREFIX) and f.endswith(".safetensors"))


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
        self.plan = plan_files({r.name: TensorSpec(r.full_shape, r.need.dtype) for r in self.regions}, max_file_bytes,
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
