"""A merged weight export in a quantized release's own format (``merged_format='release'``): as buckets, what
``save_merged(merged_format='release')`` writes as files.

The rule is merged_export's :func:`~twinkle_strategy.checkpoint.merged_export.release_rewrite`, shared with the save:

* each merged weight (an adapter's target: ``base + delta``) in the model's dtype, from the ranks that own its
  rows as in every merged export, under the release's key (DeepSeek-V4-Flash's keys have no ``model.``); its
  module is one of :attr:`ReleaseTensors.modules`, which the engine loads unquantized
  (``quantization_config.modules_to_not_convert``, as the saved directory's config.json lists them);
* every other tensor of the release as the release stores it, byte for byte (quantized bytes and their scales,
  plain tensors in their stored dtype), read from the release's files by the destination, a bucket at a time,
  after the merged weights. No rank holds them otherwise in that form (a ``keep`` rank holds its rows with the
  scale rows they need, split at FSDP2's row bounds), and training never changes them: a ``changed_only``
  export leaves them out.

Merged weights are not re-quantized: ``base + delta`` is not on the release's grid of block-scaled FP8/FP4
values, so a re-quantized weight would not be the trained one (merged_export says the same of the save).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.checkpoint.merged_export import release_rewrite, untouched_release_tensors
from twinkle_strategy.checkpoint.reading import SafetensorsIndex
from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.distributed.messages import collective_device
from twinkle_strategy.errors import ArgumentError, WeightSyncError
from twinkle_strategy.quantized.formats import quant_format


@dataclasses.dataclass
class ReleaseTensors:
    """The release's tensors that no merged weight replaces, planned on the destination into buckets of at most
    ``bucket_bytes`` (one larger tensor: a bucket of its own); every rank knows how many buckets there are."""

    release: str
    buckets: list[list[tuple[str, tuple[int, ...], torch.dtype]]]  # the destination's: (key, shape, dtype)
    count: int  # the number of buckets, on every rank
    modules: tuple[str, ...]  # the merged modules: the engine loads them unquantized
    renames: dict[str, str]  # a merged weight's checkpoint key as saved -> the release's key
    _index: SafetensorsIndex | None = None

    def bucket_bytes(self, n: int) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.buckets[n]) if self.buckets else 0

    def read(self, n: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``n``'s tensors as the release stores them (on the destination)."""
        if self._index is None:
            self._index = SafetensorsIndex.from_directory(self.release)
        return [(key, self._index.read(key)) for key, _, _ in self.buckets[n]]

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None


def release_tensors(model: nn.Module, layout, merged: set[str], *, release: str | None, here: bool,
                    bucket_bytes: int, files: bool = True) -> ReleaseTensors:
    """Plan the release part of a release-format export of the PEFT ``model`` (collective: the destination
    reads the release's headers, ``here``; a failure there raises on every rank before any byte moves).
    ``layout``: the export's save layout; ``merged``: the model names of the merged weights; ``files``: False
    leaves the release's untouched tensors out (a ``changed_only`` export after a complete one)."""
    error, rewrite, buckets = None, None, []
    if here:
        try:
            if release is None:
                raise ArgumentError("merged_format='release' needs release= the local directory of the quantized "
                                 "release the model was loaded from")
            from transformers import AutoConfig

            rewrite = release_rewrite(release, quant_format(AutoConfig.from_pretrained(release)),
                                      model.get_base_model(), layout, merged)
            index = SafetensorsIndex.from_directory(release)
            try:
                tensors = [(key, tuple(index.tensors[key].shape), index.tensors[key].dtype)
                           for keys in untouched_release_tensors(release, rewrite).values() for key in keys]
            finally:
                index.close()
            buckets = _pack(tensors, bucket_bytes) if files else []
        except Exception as exc:  # noqa: BLE001 - raised on every rank just below
            error = exc
    raise_together(error, "planning the weight export in the release's format (before any byte moved)",
                   WeightSyncError)
    count = torch.tensor([len(buckets)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return ReleaseTensors(release or "", buckets, int(count.item()), rewrite.modules if rewrite else (),
                          rewrite.release_keys if rewrite else {})


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _pack(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[list]:
    buckets, size = [], 0
    for tensor in tensors:
        nbytes = _nbytes(tensor[1], tensor[2])
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets
