"""A merged export of a LoRA run (``merge_lora``): the base model with its adapters added in, as a checkpoint.

PEFT's own merge (``merge_and_unload``) adds each adapter's delta into its base weight in place. Under FSDP2
that weight is a shard, and with ``quantized_base: keep`` it is a :class:`~twinkle_strategy.quantized.kept.
KeptWeight`, which refuses writes. So the merge here goes one FSDP2 unit at a time:

1. ``unshard()`` the unit: FSDP2 gathers its weights (a kept weight decodes its shard for the all-gather, as it
   does for a forward), so every LoRA layer of the unit sees its whole base weight and whole adapter;
2. each LoRA layer's merged weight is ``base + get_delta_weight()``, PEFT's own delta in the base's dtype (what
   PEFT's ``merge`` adds), of which this rank keeps its FSDP2 rows; ``reshard()`` frees the gathered unit.

Then PEFT's ``unload`` gives back the transformers model (the LoRA layers replaced by their base layers, the
parameters the same FSDP2 ones), each merged weight's shard becomes its merged rows, and
:func:`~twinkle_strategy.checkpoint.training.save_pretrained` writes it in the checkpoint's key layout (the
merged export's kind of save), every rank its own rows. The frozen weights no adapter touched are written as they
are held (a kept one decoded): a plain checkpoint in the model's dtype (``MergedFormat.BF16``).

``MergedFormat.RELEASE`` saves only the merged weights that way, then one process assembles the directory from
the release's own files (:func:`assemble_release_format`): every untouched tensor byte for byte, the merged
ones under the release's keys.

Peak memory: this rank's merged shards (the adapters' targets, in the model dtype) plus one gathered unit.
The export consumes the model (its adapters are merged away): call it once training is done.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import shutil

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint.directories import check_shared_directory
from twinkle_strategy.checkpoint.layout import CheckpointLayout
from twinkle_strategy.checkpoint.reading import SafetensorsIndex
from twinkle_strategy.checkpoint.save_plan import (
    CHUNK_BYTES,
    Publish,
    SaveContext,
    SavePlan,
    execute_save,
    is_peft_model,
)
from twinkle_strategy.checkpoint.training import SaveKind, SaveSources, declare, save_pretrained
from twinkle_strategy.checkpoint.writing import DEFAULT_MAX_FILE_BYTES, plan_model_files
from twinkle_strategy.compat.torch_internals import replace_local_tensor
from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.quantized.formats import QuantFormat, QuantizedIndex, quant_format


class MergedFormat(str, enum.Enum):
    """How a merged export stores the weights no adapter touched."""

    BF16 = "bf16"  # every weight in the model's dtype: a plain checkpoint
    # A quantized release's own files for them, byte for byte (quantized bytes and scales); each merged weight in
    # the model's dtype, listed in quantization_config.modules_to_not_convert. Re-quantizing a merged weight is
    # not exact (base + delta is not on the release's grid of block-scaled FP8/FP4 values), so it is not done.
    RELEASE = "release"


@dataclasses.dataclass
class MergedModel:
    """The transformers model after :func:`merge_adapters`, and what a save of it needs."""

    model: nn.Module
    ep_plan: ExpertParallelPlan | None  # the strategy's plan under the model's own names (PEFT's prefixes gone)
    merged: set[str]  # the model's names of the weights an adapter was merged into


MERGED_WEIGHTS_DIR = ".merged-weights"  # the merged weights, before the release's files are assembled around them


def save_merged(model: nn.Module, directory: str, *, ep_plan: ExpertParallelPlan | None,
                merged_format: MergedFormat | str = MergedFormat.BF16, release: str | None = None,
                max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                chunk_bytes: int = CHUNK_BYTES) -> tuple[list[str], ExpertParallelPlan | None]:
    """A PEFT model's adapters merged into its base, saved in ``directory`` (collective;
    ``NativeFSDPStrategy.save_merged``, which documents the formats). Consumes the model. Returns the merged
    modules (release, rank 0) and the expert-parallel plan under the merged model's own names."""
    merged_format = MergedFormat(merged_format)
    if merged_format == MergedFormat.RELEASE and (release is None or not os.path.isfile(
            os.path.join(release, "config.json"))):
        raise ArgumentError(f"save_merged(merged_format='release') needs release= the local directory of the "
                         f"quantized release the model was loaded from (got {release!r})")
    if not is_peft_model(model):
        raise ArgumentError("save_merged takes a PEFT model (its adapters are what is merged); "
                         "save a full model with save_pretrained")
    merged = merge_adapters(model, ep_plan)
    if merged_format == MergedFormat.BF16:
        save_pretrained(merged.model, directory, ep_plan=merged.ep_plan, max_file_bytes=max_file_bytes,
                        chunk_bytes=chunk_bytes, items=declare(SaveKind.MERGED_EXPORT))
        return [], merged.ep_plan
    directory = os.path.normpath(directory)
    check_shared_directory(os.path.dirname(os.path.abspath(directory)), what="the directory given to save_merged")
    from transformers import AutoConfig  # (the release's config loaded already: from_pretrained read it)

    release_files = ReleaseFiles(release, quant_format(AutoConfig.from_pretrained(release)), merged)
    items = declare(SaveKind.MERGED_RELEASE_EXPORT, sources=SaveSources(
        merged_names=frozenset(merged.merged), merged_subdirectory=MERGED_WEIGHTS_DIR, release_files=release_files))
    execute_save(SavePlan(directory, tuple(items), publish=Publish.MERGE, max_file_bytes=max_file_bytes,
                          chunk_bytes=chunk_bytes, subject=f"saving {directory}", advice="", report=False),
                 model=merged.model, ep_plan=merged.ep_plan)
    return release_files.modules, merged.ep_plan


@dataclasses.dataclass(frozen=True)
class ReleaseFiles:
    """A save item (rank 0): the release's own files around the merged weights (``Part.MERGED_WEIGHTS``) wrote into
    :data:`MERGED_WEIGHTS_DIR`, every untouched tensor byte for byte; the merged modules noted in ``modules``."""

    release: str
    release_format: QuantFormat | None
    merged: MergedModel
    modules: list[str] = dataclasses.field(default_factory=list)

    def write(self, ctx: SaveContext) -> None:
        ctx.on_rank0("the release's files", lambda: self._assemble(ctx.directory))

    def _assemble(self, directory: str) -> None:
        merged, merged_dir = self.merged, os.path.join(directory, MERGED_WEIGHTS_DIR)
        save_layout = plan_model_files(merged.model, merged.ep_plan, names=merged.merged)[0]
        rewrite = release_rewrite(self.release, self.release_format, merged.model, save_layout, merged.merged)
        self.modules.extend(assemble_release_format(self.release, merged_dir, directory, rewrite))
        shutil.rmtree(merged_dir)


def merge_adapters(peft_model: nn.Module, ep_plan: ExpertParallelPlan | None) -> MergedModel:
    """Merge ``peft_model``'s active adapters into its FSDP2 shards (collective) and return the transformers
    model without the adapters. Kept weights (``quantized_base: keep``) are never written: a merged one is
    replaced by a plain shard of its merged values."""
    peft_names = {id(param): name for name, param in peft_model.named_parameters()}
    merged = merged_shards(peft_model)
    model = peft_model.unload()  # the LoRA layers replaced by their base layers: the same parameters
    for param, rows in merged.values():
        replace_local_tensor(param, rows)
    names = {peft_names[id(param)]: name for name, param in model.named_parameters()}
    if ep_plan is not None:
        ep_plan = dataclasses.replace(ep_plan, axes={names[old]: axis for old, axis in ep_plan.axes.items()
                                                     if old in names})
    return MergedModel(model, ep_plan, {names[peft_names[key]] for key in merged})


def merged_shards(peft_model: nn.Module) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
    """id(sharded base weight) -> (it, this rank's FSDP2 rows of base + PEFT's delta), for every weight an active
    adapter modifies (collective: one FSDP2 unit gathered at a time). Changes nothing in the model."""
    from peft.tuners.lora import LoraLayer

    merged: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # id(sharded parameter) -> (it, merged rows)
    units = [module for module in peft_model.modules() if isinstance(module, FSDPModule)]
    for unit in reversed(units):  # the root unit last: each nested unit gathers on its own
        sharded = {name: param for name, param in unit.named_parameters()}
        unit.unshard()
        try:
            for name, layer in unit.named_modules():
                if not isinstance(layer, LoraLayer) or not _owned_by(unit, name, units):
                    continue
                for adapter in layer.active_adapters:
                    base_name, base = _base_parameter(layer)
                    full = base + layer.get_delta_weight(adapter)  # what PEFT's merge adds, in the base's dtype
                    param = sharded[f"{name}.{base_name}" if name else base_name]
                    merged[id(param)] = (param, _my_rows(param, full))
        finally:
            unit.reshard()
    return merged


def _owned_by(unit: nn.Module, name: str, units: list[nn.Module]) -> bool:
    """Whether the LoRA layer ``name`` (inside ``unit``) is gathered by ``unit`` rather than a nested unit."""
    parts = name.split(".") if name else []
    return not any(unit.get_submodule(".".join(parts[:i])) in units for i in range(1, len(parts) + 1))


def _base_parameter(layer) -> tuple[str, torch.Tensor]:
    """The weight a LoRA layer adapts: its name under the layer, and the (gathered) tensor.

    ``Linear`` adapts ``base_layer.weight``; an expert ``ParamWrapper`` (``target_parameters``) adapts the
    parameter it names, on its innermost base layer (wrappers of one experts module nest)."""
    parameter_name = getattr(layer, "parameter_name", None)
    if parameter_name is None:
        return "base_layer.weight", layer.get_base_layer().weight
    path, module = "base_layer", layer.base_layer
    while parameter_name not in dict(module.named_parameters(recurse=False)):
        path, module = f"{path}.base_layer", module.base_layer
    return f"{path}.{parameter_name}", getattr(module, parameter_name)


def _my_rows(param, full: torch.Tensor) -> torch.Tensor:
    """This rank's FSDP2 rows of ``full`` (the parameter's whole value on its mesh), as its shard holds them:
    dim 0 in chunks of ``ceil(rows / mesh size)``, the last ones short or empty."""
    local = param.to_local()
    chunk = math.ceil(full.shape[0] / param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * chunk, full.shape[0])
    rows = full[start:start + local.shape[0]].to(local.dtype).contiguous()
    if rows.shape != local.shape:
        raise AssertionError(f"merged rows {tuple(rows.shape)} do not fit the shard {tuple(local.shape)}")
    return rows


MERGED_PREFIX = "model-merged"  # the files of the merged weights, next to the release's


def release_keys_of(save_layout, release_layout, names: set[str]) -> dict[str, str]:
    """Checkpoint key as saved -> the release's key for the same tensor, for the model tensors ``names``.

    A save writes transformers' own key layout, which may name a tensor otherwise than the release does
    (DeepSeek-V4-Flash ships its keys without ``model.``). Both layouts list, per model tensor and source
    pattern of its rule, the checkpoint keys it is made of, in transformers' order: the pairs are read there."""
    out = {}
    for name in sorted(names):
        saved, released = save_layout.recipes[name].sources, release_layout.recipes[name].sources
        pairs = ([(saved[p], released[p]) for p in saved] if saved.keys() == released.keys()
                 else [([k for keys in saved.values() for k in keys], [k for keys in released.values() for k in keys])])
        for saved_keys, released_keys in pairs:
            if len(saved_keys) != len(released_keys):
                raise AssertionError(f"'{name}' is saved as {saved_keys} but the release has {released_keys}")
            out.update(zip(saved_keys, released_keys, strict=True))
    return out


@dataclasses.dataclass(frozen=True)
class ReleaseRewrite:
    """What a merged export in the release's format changes in the release: the one rule of ``save_merged``'s
    release format and of the weight export's (:mod:`twinkle_strategy.rl.export_release`)."""

    release_keys: dict[str, str]  # each merged weight's checkpoint key as saved -> the release's key
    dropped: frozenset[str]  # the release's stored tensors they replace: quantized data and its scale
    modules: tuple[str, ...]  # the merged modules, for quantization_config.modules_to_not_convert


def release_rewrite(release: str, release_format: QuantFormat | None, model: nn.Module, save_layout,
                    names: set[str]) -> ReleaseRewrite:
    """The :class:`ReleaseRewrite` of merging the model tensors ``names`` (``save_layout``: the layout they are
    saved in) into ``release``, from the release's headers. The stored tensors of a merged key are named by a
    :class:`~twinkle_strategy.quantized.formats.QuantizedIndex` of the release: a merged FP8 weight drops its
    ``weight_scale_inv``, an MXFP4 one its ``_blocks`` and ``_scales``."""
    index = QuantizedIndex(SafetensorsIndex.from_directory(release), release_format, model)
    try:
        release_layout = CheckpointLayout(index, model, release, model_tensors=save_layout.model_tensors)
        keys = release_keys_of(save_layout, release_layout, names)
        dropped = set()
        for key in keys.values():
            logical = index.tensors[key]
            dropped |= {logical.data_key} | ({logical.scale_key} if logical.scale_key else set())
    finally:
        index.close()
    return ReleaseRewrite(keys, frozenset(dropped), tuple(sorted({_module_of(key) for key in keys.values()})))


def untouched_release_tensors(release: str, rewrite: ReleaseRewrite) -> dict[str, list[str]]:
    """Each safetensors file of ``release`` and its tensors that no merged weight replaces, in the file's order."""
    return {file: [key for key in keys if key not in rewrite.dropped] for file, keys in _files_of(release).items()}


def assemble_release_format(release: str, merged_dir: str, directory: str, rewrite: ReleaseRewrite) -> list[str]:
    """Fill ``directory`` (one process) with ``release``'s files for every weight no adapter touched, byte for
    byte, and the merged weights saved in ``merged_dir`` (model dtype, checkpoint keys as saved, renamed by
    ``rewrite.release_keys`` to the release's) in place of theirs.

    A release file that holds none of ``rewrite.dropped`` is copied whole; one that does is rewritten without
    them (its other tensors as stored). Returns the merged modules, which config.json lists in
    ``quantization_config.modules_to_not_convert`` (transformers' quantizers then load them as they are)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    release_keys, dropped = rewrite.release_keys, rewrite.dropped
    weight_map = {}
    for file, keys in _files_of(release).items():
        if not dropped & set(keys):
            shutil.copyfile(os.path.join(release, file), os.path.join(directory, file))
        else:
            with safe_open(os.path.join(release, file), "pt") as reader:
                kept = {key: reader.get_tensor(key) for key in keys if key not in dropped}
                metadata = reader.metadata()
            save_file(kept, os.path.join(directory, file), metadata=metadata)
        weight_map.update({key: file for key in keys if key not in dropped})
    for file, keys in _files_of(merged_dir).items():
        renamed = MERGED_PREFIX + file.removeprefix("model")  # model-00001-of-00002.safetensors, model.safetensors
        with safe_open(os.path.join(merged_dir, file), "pt") as reader:  # one file of merged weights at a time
            save_file({release_keys[key]: reader.get_tensor(key) for key in keys}, os.path.join(directory, renamed),
                      metadata=reader.metadata())
        weight_map.update({release_keys[key]: renamed for key in keys})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as out:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, out, indent=2)
    modules = list(rewrite.modules)
    with open(os.path.join(release, "config.json")) as source:
        config = json.load(source)
    spec = config["quantization_config"]
    spec["modules_to_not_convert"] = sorted(set(spec.get("modules_to_not_convert") or []) | set(modules))
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
    for name in os.listdir(release):  # tokenizer, generation config ...: as the release has them
        if not name.endswith(".safetensors") and name not in ("model.safetensors.index.json", "config.json") \
                and os.path.isfile(os.path.join(release, name)):
            shutil.copyfile(os.path.join(release, name), os.path.join(directory, name))
    return modules


def _files_of(directory: str) -> dict[str, list[str]]:
    """The safetensors files of a checkpoint directory and the keys each holds."""
    from safetensors import safe_open

    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), "pt") as reader:
                out[file] = list(reader.keys())
    return out


def _index_keys(directory: str) -> list[str]:
    return sorted(key for keys in _files_of(directory).values() for key in keys)


def _module_of(key: str) -> str:
    """The module a checkpoint weight belongs to: ``...q_b_proj.weight`` -> ``...q_b_proj``; an experts
    tensor (``...mlp.experts.gate_up_proj``, ``...experts.0.w1.weight``) -> its experts module."""
    parts = key.split(".")
    if "experts" in parts:
        return ".".join(parts[:parts.index("experts") + 1])
    return key.rsplit(".", 1)[0]
