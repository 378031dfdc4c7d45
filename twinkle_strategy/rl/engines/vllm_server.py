"""vLLM as a server: the export as a ``WeightSource``, for vLLM's own trainer-side weight transfer.

vLLM (0.32) has a trainer side for its RL weight transfer (``vllm.distributed.weight_transfer``): every trainer
rank calls ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` once and
``send_weights()`` after each step. The sender, trainer rank 0, drives the server through the client
(``HTTPVLLMWeightSyncClient``: ``/start_weight_update``, ``/update_weights`` with every tensor's name, dtype and
shape, ``/finish_weight_update``, which runs vLLM's layerwise reload on the server) while it streams the source's
tensors to the server's workers (NCCL, GPU only); the other ranks iterate the source to stay in its collectives.

:func:`export_weight_source` is that source: each round one :meth:`NativeFSDPStrategy.export_weights` to trainer
rank 0. ``metadata()`` (called first, on every rank) plans the round's export and declares the tensors rank 0
will receive, in the checkpoint's names, dtypes and shapes (what vLLM's ``load_weights`` takes: per-expert keys,
conversions reverted); iteration walks that export (collective on every rank): rank 0 yields each bucket's
tensors as they arrive, no rank ever holding the model. The next ``metadata()`` plans the next round's export (so
``changed_only`` declares only what that export sends).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from twinkle_strategy.rl.export_plan import OneReceiver
from twinkle_strategy.rl.export_report import ExportReport
from twinkle_strategy.rl.weight_export import WeightExport

SENDER = 0  # vLLM's trainer engines send from trainer rank 0 (TrainerInitInfo.is_sender)


def export_weight_source(strategy, model: nn.Module, *, bucket_bytes: int = 256 * 2**20, dtype: torch.dtype | None = None,
                         lora: str = "merged", changed_only: bool = False):
    """A vLLM ``WeightSource`` whose every pass is one export of ``model`` to trainer rank 0 (the options are
    :meth:`NativeFSDPStrategy.export_weights`'s). Build it on every trainer rank and hand it to vLLM's
    ``WeightTransferTrainerFactory.trainer_init(..., source=...)``; docs/rl.md, "vLLM as a server"."""

    def plan() -> WeightExport:
        return strategy.export_weights(model, bucket_bytes=bucket_bytes, dtype=dtype, lora=lora,
                                       changed_only=changed_only, receivers=OneReceiver(SENDER))

    return _source_class()(plan)


@functools.cache
def _source_class() -> type:
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    except ImportError as exc:
        raise ImportError(f"export_weight_source needs vLLM's weight transfer (vllm >= 0.32, "
                          f"vllm.distributed.weight_transfer): pip install vllm ({exc})") from None

    class ExportWeightSource(WeightSource):
        """vLLM's ``WeightSource`` over :class:`WeightExport` rounds (see the module's docstring)."""

        def __init__(self, plan: Callable[[], WeightExport]):
            self._plan = plan
            self._planned: WeightExport | None = None
            self.last_export: WeightExport | None = None

        def metadata(self) -> list[ParamMeta]:
            if self._planned is None:
                self._planned = self._plan()
            return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in self._planned.manifest(rank=SENDER)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            export, self._planned = self._planned or self._plan(), None
            self.last_export = export
            for bucket in export:  # every rank in step; the tensors only on the sender
                yield from bucket.tensors

        @property
        def report(self) -> ExportReport | None:
            """The last completed round's figures (bytes per rank, seconds, buckets)."""
            return None if self.last_export is None else self.last_export.report

    return ExportWeightSource
