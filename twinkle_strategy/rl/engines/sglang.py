"""SGLang as a receiver of the export: ``Engine.update_weights_from_tensor``, one call per bucket.

SGLang's offline engine (``sglang.Engine``, 0.5) loads ``(name, tensor)`` pairs in checkpoint names through its
model's ``load_weights`` (``update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``: the
pairs serialised by its ``MultiprocessingSerializer``, one payload per tensor-parallel rank, CUDA IPC handles for
GPU tensors). :class:`SGLangReceiver` calls it once per bucket without flushing, and flushes the engine's cache
once after the last bucket (``Engine.flush_cache``), as SGLang asks of a multi-call update. SGLang runs on GPUs
only; this adapter needs the ``sglang`` package only for the engine it is given.
"""

from __future__ import annotations

from twinkle_strategy.errors import ArgumentError, ArgumentTypeError
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta


class SGLangReceiver:
    """Feeds :meth:`WeightExport.send_to`'s buckets to ``engine`` (a ``sglang.Engine`` in the destination rank's
    process). ``load_format``: SGLang's (None: plain tensors)."""

    def __init__(self, engine, *, load_format: str | None = None):
        if not all(callable(getattr(engine, m, None)) for m in ("update_weights_from_tensor", "flush_cache")):
            raise ArgumentTypeError(f"SGLangReceiver needs an SGLang engine (sglang.Engine: update_weights_from_tensor and "
                            f"flush_cache), got {type(engine).__name__}: pip install sglang")
        self.engine, self.load_format = engine, load_format
        self.buckets = 0

    def prepare(self, manifest: list[TensorMeta]) -> None:
        if not manifest:
            raise ArgumentError("the export holds no tensor; nothing to send to the SGLang engine")
        self.buckets = 0

    def __call__(self, bucket: Bucket) -> None:
        result = self.engine.update_weights_from_tensor(named_tensors=list(bucket.tensors),
                                                        load_format=self.load_format, flush_cache=False)
        _check(result, f"bucket {bucket.index}")
        self.buckets += 1

    def finish(self) -> None:
        _check(self.engine.flush_cache(), "flush_cache after the update")


def _check(result, what: str) -> None:
    """SGLang reports a refused update as ``(False, message)`` (or an object with ``success``) rather than raising."""
    success = getattr(result, "success", None)
    message = getattr(result, "message", None)
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], (result[1] if len(result) > 1 else None)
    if success is False:
        raise RuntimeError(f"the SGLang engine refused {what}: {message}")
