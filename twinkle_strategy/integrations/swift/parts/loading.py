"""Model loading inside swift: ``PreTrainedModel.from_pretrained`` as the strategy wants it while swift loads.

Without memory_efficient_init every rank loads on CPU through the library's one whole-model load,
``loading.load_pretrained_strict`` (missing, unexpected or wrong-shaped tensors raise, named). With it, each node's source opens the checkpoint (streaming where it can) and
every other rank builds the model on meta; failures are raised on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from twinkle_strategy.config import QuantizedBase
from twinkle_strategy.distributed.fail_together import raise_init_together
from twinkle_strategy.integrations.swift.parts.state import STATE, get_strategy
from twinkle_strategy.loading import load_pretrained_strict, open_on_this_rank, share_weight_conversions

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")


def _dtype(config, kwargs):
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _load_whole(from_pretrained, cls, path, *args, **kwargs):
    """swift's ``cls.from_pretrained(path, ...)`` as the library loads a whole model (``load_pretrained_strict``)."""
    kwargs["device_map"] = None  # CPU: shards go to the devices in wrap_model; no rank holds a whole model there
    # swift asks for ignore_mismatched_sizes only where it replaces a head on purpose (reward models); otherwise
    # the library asks for it itself, so that transformers reports the mismatched tensors and it raises naming them.
    strict = kwargs.pop("ignore_mismatched_sizes", None) is not True
    return load_pretrained_strict(str(path), from_pretrained=lambda p, **kw: from_pretrained(cls, p, *args, **kw),
                                  strict=strict, **kwargs)


@contextlib.contextmanager
def _strategy_from_pretrained(strategy):
    """``PreTrainedModel.from_pretrained`` as the strategy wants it, while swift loads the model."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    from_pretrained = original.__func__

    def patched(cls, path, *args, config=None, **kwargs):
        if not strategy.memory_efficient_init:
            return _load_whole(from_pretrained, cls, path, *args, config=config, **kwargs)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
        dtype = _dtype(config, kwargs)
        # swift asks for ignore_mismatched_sizes where it replaces a head on purpose (reward models): a full load.
        model = open_on_this_rank(
            path, config, dtype, topology=strategy.topology, stream=strategy.config.stream_checkpoint,
            full_load=lambda: _load_whole(from_pretrained, cls, path, *args, config=config, **kwargs),
            model_class=cls, kwargs={k: v for k, v in kwargs.items() if k != "output_loading_info"},
            blocker="from_pretrained was given positional arguments" if args else None,
            quantized_base=QuantizedBase(strategy.config.quantized_base))
        if isinstance(model, tuple):  # the full load, asked for its loading report
            return model
        report = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return (model.eval(), report) if kwargs.get("output_loading_info") else model.eval()

    PreTrainedModel.from_pretrained = classmethod(patched)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def load(orig, self):
    """Hook of ``ModelLoader.load``: the model as the strategy loads it (memory_efficient_init: no weights but the source's)."""
    if not getattr(self, "load_model", False) or getattr(self, "return_dummy_model", False):
        return orig(self)
    strategy = get_strategy()
    result, error = None, None
    try:
        with _strategy_from_pretrained(strategy):
            result = orig(self)
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    raise_init_together(error, f"loading {self.model_info.model_dir}")
    if strategy.memory_efficient_init:
        share_weight_conversions(result[0] if isinstance(result, tuple) else result, strategy.topology,
                                 strategy.node_group)
    STATE.loaded_checkpoint = not (strategy.memory_efficient_init and not strategy.topology.is_source)
    if strategy.is_main_process:
        where = ("each node's local rank 0 opened it, every rank built the model without weights "
                 "(wrap_model sends each rank its shards)" if strategy.memory_efficient_init
                 else "every rank loaded it on CPU")
        logger.info("twinkle swift plugin: %s: %s", self.model_info.model_dir, where)
    return result


# swift wraps some experts classes' forward while loading (Qwen3-VL-MoE: a cast of the output to the
# input's dtype) in a ``forward(hidden_states, *args, **kwargs)`` that passes everything through but
# hides the signature expert parallelism reads its call contract from. Marking the original as
# ``__wrapped__`` (what functools.wraps would have done) shows it again; swift's cast still runs.
_SWIFT_EXPERTS_PATCHES = {
    "patch_Qwen3VLMoeTextExperts_dtype": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                                          "Qwen3VLMoeTextExperts"),
}


def _expose_wrapped_forward(orig, module_name: str, class_name: str):
    import importlib

    experts_class = getattr(importlib.import_module(module_name), class_name)
    before = experts_class.forward
    result = orig()
    after = experts_class.forward
    if after is not before and not hasattr(after, "__wrapped__"):
        after.__wrapped__ = before
    return result


def install_experts_patch_hooks() -> None:
    from swift.model.models import qwen

    for function_name, (module_name, class_name) in _SWIFT_EXPERTS_PATCHES.items():
        original = getattr(qwen, function_name, None)
        if original is None or getattr(original, "_twinkle_hook", False):
            continue  # another swift version, or already hooked
        hook = functools.partial(_expose_wrapped_forward, original, module_name, class_name)
        hook._twinkle_hook = True
        setattr(qwen, function_name, hook)
