"""A receiver that loads an export into a vLLM engine held in the same process (TRL's colocate mode).

vLLM must not get a bare ``model.load_weights``: its layers keep weights in kernel formats made once after
loading (``process_weights_after_loading``: on CPU the fused-MoE layer repacks its experts; FlashInfer and
quantized layers likewise), and a raw load writes checkpoint-format values into those tensors (SkyRL #1680).
vLLM's in-place reload (``vllm.model_executor.model_loader.reload``, what ``reload_weights`` runs) does it right:
``initialize_layerwise_reload`` puts every layer back into its checkpoint format and wraps its weight loaders, each
layer is processed again as soon as all its weights arrived, and ``finalize_layerwise_reload`` processes what is
left (attention; a layer no bucket touched gets its old kernel tensors back). :class:`VLLMReceiver` runs the same
three stages, one per receiver call: ``prepare`` the first, each bucket through the model's own ``load_weights``
(vLLM's checkpoint-name mapping: fused qkv, per-expert keys into w13/w2), ``finish`` the last.

Each stage runs on every engine worker through ``LLM.collective_rpc`` with a function: in process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; an engine in its own process takes the functions pickled (vLLM's
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) and each bucket's tensors with them.
"""

from __future__ import annotations

from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta


def _start(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        model.twinkle_dropped_moe_kernels = _forget_cpu_moe_kernels(model)
        initialize_layerwise_reload(model)


def _forget_cpu_moe_kernels(model) -> dict:
    """vLLM 0.32's unquantized MoE method treats a reload as a weight update once its kernel is built: it copies
    the new weights into the kernel tensors and skips the experts' own ``process_weights_after_loading``. On CPU
    that step pads the intermediate size and prepacks the experts for the grouped GEMM, so the update would copy
    unpacked checkpoint values into packed storage (a shape error, or wrong rollouts where the shapes agree).
    Dropping the built kernel makes the reload take the first-load path (pad, prepack, a new kernel), whose result
    the reload copies into the engine's own tensors. Returns each changed method's kernel: a layer no bucket
    touches (an export of some tensors only) gets it back in ``_finish``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    dropped = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            dropped[method] = method.moe_kernel
            method.moe_kernel = None
    return dropped


def _load(worker, tensors) -> list[str]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.model_runner.get_model().load_weights(iter(tensors))
    return sorted(loaded or ())


def _finish(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    # MoE layers the export did not touch kept their tensors: their kernels come back as they were.
    for method, kernel in getattr(model, "twinkle_dropped_moe_kernels", {}).items():
        if method.moe_kernel is None:
            method.moe_kernel = kernel
    model.twinkle_dropped_moe_kernels = {}
    # What reload_weights resets after a reload: state derived from the old weights.
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(runner, reset, lambda: None)()


def _model_type(worker) -> str:
    return worker.vllm_config.model_config.hf_config.model_type


class VLLMReceiver:
    """Loads :meth:`WeightExport.send_to`'s buckets into ``llm`` (a ``vllm.LLM``) through vLLM's reload lifecycle.

    ``model_type`` (optional) is the trained model's ``config.model_type``: a different engine model is refused
    in ``prepare``, before any byte moves. The engine's prefix cache is reset after the last bucket (cached KV
    blocks were computed by the old weights)."""

    def __init__(self, llm, *, model_type: str | None = None):
        self.llm, self.model_type = llm, model_type
        self.started = False
        self.buckets = 0
        self.loaded: set[str] = set()

    def prepare(self, manifest: list[TensorMeta]) -> None:
        if self.model_type is not None:
            engine_types = set(self.llm.collective_rpc(_model_type))
            if engine_types != {self.model_type}:
                raise ArgumentError(f"the vLLM engine serves model_type {sorted(engine_types)}, the export is of "
                                 f"'{self.model_type}': start the engine from the trained model's own checkpoint")
        if not manifest:
            raise ArgumentError("the export holds no tensor; nothing to load into the vLLM engine")
        self.llm.collective_rpc(_start)
        self.started, self.buckets, self.loaded = True, 0, set()

    def __call__(self, bucket: Bucket) -> None:
        if not self.started:
            raise RuntimeError("VLLMReceiver got a bucket before prepare(manifest)")
        for loaded in self.llm.collective_rpc(_load, args=(bucket.tensors,)):
            self.loaded.update(loaded)
        self.buckets += 1

    def finish(self) -> None:
        if not self.started:
            raise RuntimeError("VLLMReceiver.finish() without prepare(manifest)")
        self.llm.collective_rpc(_finish)
        self.started = False
        self.llm.reset_prefix_cache()
