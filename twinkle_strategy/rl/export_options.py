"""The options of ``strategy.export_weights``, turned into a :class:`~twinkle_strategy.rl.weight_export.WeightExport`:
what a LoRA model sends (merged, in the engine's dtype or in its quantized release's format, or the adapter alone),
to whom, and what a ``changed_only`` export leaves out (what training never changes)."""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.checkpoint.merged_export import MergedFormat
from twinkle_strategy.checkpoint.training import is_peft_model
from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.rl.export_plan import EngineExperts, OneReceiver
from twinkle_strategy.rl.export_release import release_tensors
from twinkle_strategy.rl.export_sources import LoraExport, export_source
from twinkle_strategy.rl.weight_export import WeightExport

_EXPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the LoRA modes exported from it once


def export_weights(model: nn.Module, ep_plan: ExpertParallelPlan | None, *, bucket_bytes: int,
                   changed_only: bool = False, lora: LoraExport | str = LoraExport.MERGED,
                   dtype: torch.dtype | None = None, receivers: OneReceiver | EngineExperts | None = None,
                   merged_format: MergedFormat | str = MergedFormat.BF16, release: str | None = None) -> WeightExport:
    """``model``'s weights for a rollout engine (collective; :meth:`NativeFSDPStrategy.export_weights`).

    ``bucket_bytes``: the most a bucket holds (a single larger tensor: a bucket of its own). ``receivers``:
    ``OneReceiver(rank)`` (default rank 0), or ``EngineExperts(ranks)`` for an expert-parallel engine (engine rank
    j, fed by trainer rank ``ranks[j]``, gets its experts and every other tensor). ``changed_only``: after a first
    complete export of this model, only what training changes (the trainable tensors; for LoRA the weights its
    adapters modify). ``lora``: ``merged`` (the adapters added into their base weights, the model unchanged) or
    ``adapter`` (the adapter alone, PEFT's keys). ``dtype``: the engine's dtype for floating tensors, each as
    ``from_pretrained(dtype=...)`` gives it (fp32-kept routers stay fp32); None: as trained. ``merged_format``
    (a merged LoRA export): ``bf16``, every weight in ``dtype`` (a ``quantized_base: keep`` run's frozen weights
    decoded, the rows each rank sends only); ``release`` (with ``release=`` the quantized release's local
    directory, one receiver): what ``save_merged(merged_format='release')`` writes
    (:mod:`twinkle_strategy.rl.export_release`).
    """
    receivers = receivers or OneReceiver()
    lora, merged_format = LoraExport(lora), MergedFormat(merged_format)
    in_release = merged_format == MergedFormat.RELEASE
    if in_release and (lora != LoraExport.MERGED or not isinstance(receivers, OneReceiver)
                       or not is_peft_model(model)):
        raise ArgumentError("merged_format='release' exports a LoRA model's merged weights (lora='merged') to one "
                         f"receiver (OneReceiver); got lora='{lora.value}', receivers={receivers}"
                         + ("" if is_peft_model(model) else ", and a model without adapters"))
    source = export_source(model, ep_plan, lora=lora, dtype=dtype)
    exported, mode = _EXPORTED.setdefault(model, set()), (lora, merged_format)
    again = changed_only and mode in exported
    if again or in_release:  # the release's untouched tensors come from its files: never changed by training
        source = dataclasses.replace(source, tensors=[t for t in source.tensors if t.key in source.changing])
    if in_release:
        source = dataclasses.replace(source, release=release_tensors(
            model, source.layout, set(source.changing), release=release, here=dist.get_rank() == receivers.rank,
            bucket_bytes=bucket_bytes, files=not again))
    # Only a completed export counts as the base of the next changed_only one.
    return WeightExport(source, ep_plan=ep_plan, bucket_bytes=bucket_bytes, receivers=receivers,
                        on_done=lambda: exported.add(mode))
