"""TRL's ``VLLMClient`` (a ``trl vllm-serve`` or ``vllm serve`` server) as a receiver of the export.

TRL 1.16's client updates a server's weights in one weight update (``client.weight_update()``: the server's
``/start_weight_update`` on entry, ``/finish_weight_update``, vLLM's layerwise reload, on exit); inside it,
``update_named_params(metadata, named_params)`` announces a batch of tensors (``/update_weights`` with names,
dtypes and shapes) and broadcasts them over the client's NCCL communicator (``init_communicator``: GPU only).
:class:`VLLMClientReceiver` maps the export onto that: ``prepare`` opens the weight update, each bucket is one
``update_named_params`` call, ``finish`` closes the update and resets the server's prefix cache (its KV came from
the old weights). Only the destination rank holds the client.
"""

from __future__ import annotations

from twinkle_strategy.errors import ArgumentError, ArgumentTypeError
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta


class VLLMClientReceiver:
    """Feeds :meth:`WeightExport.send_to`'s buckets to ``client`` (a ``trl.generation.vllm_client.VLLMClient``
    whose ``init_communicator`` ran). ``reset_prefix_cache``: reset the server's prefix cache after the update."""

    def __init__(self, client, *, reset_prefix_cache: bool = True):
        if not all(callable(getattr(client, m, None)) for m in ("weight_update", "update_named_params")):
            raise ArgumentTypeError(f"VLLMClientReceiver needs TRL's VLLMClient (trl >= 1.16: weight_update and "
                            f"update_named_params), got {type(client).__name__}: pip install 'trl>=1.16'")
        self.client, self.reset_prefix_cache = client, reset_prefix_cache
        self._update = None
        self.buckets = 0

    def prepare(self, manifest: list[TensorMeta]) -> None:
        if not manifest:
            raise ArgumentError("the export holds no tensor; nothing to send to the vLLM server")
        self._update = self.client.weight_update()
        self._update.__enter__()
        self.buckets = 0

    def __call__(self, bucket: Bucket) -> None:
        if self._update is None:
            raise RuntimeError("VLLMClientReceiver got a bucket before prepare(manifest)")
        metadata = [(name, str(value.dtype).removeprefix("torch."), list(value.shape)) for name, value in bucket.tensors]
        self.client.update_named_params(metadata, iter(bucket.tensors))
        self.buckets += 1

    def finish(self) -> None:
        if self._update is None:
            raise RuntimeError("VLLMClientReceiver.finish() without prepare(manifest)")
        update, self._update = self._update, None
        update.__exit__(None, None, None)
        if self.reset_prefix_cache:
            self.client.reset_prefix_cache()
