"""A model's weights as a Hugging Face checkpoint: written by every rank in parallel, read back per rank.

The files are what ``save_pretrained`` would write for the model, in the key
layout of the checkpoint it was loaded from (per-expert hub keys, renames,
by transformers' rules reversed): plain ``from_pretrained``, PEFT and
inference engines read them. No rank gathers the model: each writes the rows
it keeps (:mod:`twinkle_strategy.checkpoint.sharded_io`).
"""

from __future__ import annotations

from torch import nn

from twinkle_strategy.checkpoint.files import SafetensorsIndex
from twinkle_strategy.checkpoint.layout import CheckpointLayout, raise_for_problems
from twinkle_strategy.checkpoint.sharded_io import IOStats, read_regions, regions_of, write_regions
from twinkle_strategy.checkpoint.writer import FilePlan, OpenWriter, ParallelFileWriter, plan_files, write_index
from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.dtypes import TensorSpec
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
    save's ``open_writer`` stages them for its background writer instead)."""
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
