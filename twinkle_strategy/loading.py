"""Opening checkpoints strictly, in host memory or as a streaming skeleton (model ids: sources/model_ids.py).

Two ways to open a checkpoint:

* :func:`load_pretrained_strict`: transformers' ``from_pretrained`` on the CPU,
  the whole model in host memory. transformers quietly re-initialises tensors
  that are missing from a checkpoint, drops unexpected ones, and
  re-initialises mismatched ones when asked to ignore them; training on such
  weights is the silent failure we exist to prevent, so we ask for its loading
  report and raise a :class:`CheckpointError` naming every such tensor.
* :func:`open_streaming_model` (memory_efficient_init on a node's source): the
  model built on meta with placeholders (:mod:`twinkle_strategy.init.skeleton`)
  and the checkpoint known by its headers only
  (:class:`twinkle_strategy.checkpoint.layout.CheckpointLayout`), checked the
  same way before any weight is read. ``wrap_model`` then reads each rank's rows.

:func:`stream_blocker` says when the second is not possible (no safetensors
files, a custom-code checkpoint, ``from_pretrained`` options that
only mean something to a full load); callers then use the first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from twinkle_strategy.checkpoint.directories import is_incomplete, raise_if_incomplete
from twinkle_strategy.checkpoint.layout import CheckpointLayout, Problem, raise_for_problems
from twinkle_strategy.checkpoint.reading import SafetensorsIndex, checkpoint_files
from twinkle_strategy.compat.transformers_internals import set_weight_conversions, weight_conversions
from twinkle_strategy.config import QuantizedBase
from twinkle_strategy.distributed.node import broadcast_from_source
from twinkle_strategy.errors import (
    CheckpointError,  # noqa: F401  (raised here, importable from here)
    shorten,  # noqa: F401  (raised here, importable from here)
)
from twinkle_strategy.init.skeleton import CheckpointTensor, build_meta_model, install_placeholders
from twinkle_strategy.quantized.formats import (
    QuantizedIndex,
    drop_quantization_config,
    is_quantized_release,
    mark_quantized_release,
    quant_format,
)

logger = logging.getLogger(__name__)


def checkpoint_files_problem(path: str) -> str | None:
    """What keeps ``path`` from being a loadable checkpoint directory (config.json, safetensors weights,
    every file its index lists), or None. Reads file names and the index only."""
    if not os.path.isdir(path):
        return f"{path!r} does not exist or is not a directory"
    if is_incomplete(path):
        return f"{path!r} is an incomplete save (a process stopped while writing it); load a complete checkpoint"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path!r} has no config.json, so it is not a transformers checkpoint directory"
    try:
        files = checkpoint_files(path)
    except CheckpointError as exc:
        return str(exc)
    if not files:
        return (f"{path!r} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
                "save the checkpoint with save_pretrained(safe_serialization=True)")
    return None


def model_class_for(config):
    """The transformers auto class whose model matches the checkpoint: a causal LM, else an image-text-to-text model.

    A vision-language checkpoint (``config.architectures`` names the image-text
    class, e.g. ``Qwen3_5MoeForConditionalGeneration``) gets that class, so its
    vision tower is neither dropped on load nor missing when saved.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    image_text = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if image_text is not None and image_text in (getattr(config, "architectures", None) or []):
        return AutoModelForImageTextToText
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and image_text is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_config(path: str, **kwargs):
    from transformers import AutoConfig

    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            parse_config_json(f.read(), os.path.join(path, "config.json"))
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - OS, JSON and transformers errors alike
        raise CheckpointError(f"could not read the config of {path}: {type(exc).__name__}: {exc}. Is it a "
                              "transformers checkpoint directory with a config.json?") from exc


def read_config_text(path: str) -> str:
    """The text of ``path``'s config.json: what a source sends its node (no transformers import needed to read it)."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            text = f.read()
    except OSError as exc:
        raise CheckpointError(f"could not read the config of {path}: {exc}. Is it a transformers checkpoint "
                              "directory with a config.json?") from exc
    parse_config_json(text, file)
    return text


def parse_config_json(text: str, file: str) -> dict:
    """config.json's content, or a :class:`CheckpointError` naming the file and where its JSON breaks."""
    import json

    try:
        config = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); fix it or download the checkpoint again") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not an object of config fields; "
                              "fix it or download the checkpoint again")
    return config


def config_from_text(text: str, file: str = "config.json"):
    """A transformers config from config.json's text, exactly as ``AutoConfig.from_pretrained`` builds it.

    Every rank of a node builds its config from the text its source sends, at the same time: importing
    the model's config and model classes (seconds) then happens in parallel, not one rank after another.
    ``file`` is where the text came from, for error messages.
    """
    import tempfile

    if "AutoConfig" in (parse_config_json(text, file).get("auto_map") or {}):
        raise CheckpointError("the checkpoint's config has custom code (auto_map), which memory_efficient_init "
                              "cannot build on ranks that do not read the checkpoint; use memory_efficient_init=False")
    with tempfile.TemporaryDirectory(prefix="twinkle-config-") as directory:
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write(text)
        try:
            config = load_config(directory)
        except CheckpointError as exc:  # name the user's file, not our temporary copy
            raise CheckpointError(str(exc).replace(directory, file)) from exc.__cause__
    # Named as from_pretrained names it, not after our temporary copy: PEFT records it in adapter_config.json
    # (base_model_name_or_path) and, saving an adapter, reads its config.json to check the vocabulary.
    config.name_or_path = os.path.dirname(file)
    return config


def load_pretrained_strict(path: str, dtype: torch.dtype | None = None, *, from_pretrained: Callable | None = None,
                           strict: bool = True, output_loading_info: bool = False, **kwargs):
    """``from_pretrained`` on CPU that refuses missing, unexpected or mismatched tensors, naming them.

    The one whole-model load of the package: ``NativeFSDPStrategy.from_pretrained`` and the swift plugin
    (inside swift's own model loading) both load through here. ``from_pretrained(path, **kwargs)``: default
    that of :func:`model_class_for`'s class (the swift plugin passes the class swift asked for, with
    transformers' own method, which it has patched meanwhile). ``strict=False`` only for a
    caller that asked transformers to ignore mismatched sizes on purpose (swift replacing a head): transformers'
    report is then not refused. ``output_loading_info``: return ``(model, report)``, as transformers does.
    Any failure to read the checkpoint is a :class:`CheckpointError` naming ``path``.
    """
    kwargs.setdefault("ignore_mismatched_sizes", True)  # report them ourselves, by name
    if dtype is not None:
        kwargs["dtype"] = dtype
    raise_if_incomplete(path)
    try:
        if from_pretrained is None:
            from_pretrained = model_class_for(load_config(
                path, trust_remote_code=kwargs.get("trust_remote_code", False))).from_pretrained
        model, info = from_pretrained(path, output_loading_info=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - safetensors, OS and transformers errors alike
        raise CheckpointError(
            f"could not load the checkpoint in {path}: {type(exc).__name__}: {exc}. A file may be truncated or "
            "corrupt (re-download or re-export it), or the directory is not a transformers checkpoint"
        ) from exc
    if strict:
        raise_for_loading_info(path, info)
    return (model, info) if output_loading_info else model


def raise_for_loading_info(path: str, info: dict) -> None:
    """Raise :class:`CheckpointError` naming every missing or wrong-shaped tensor of a transformers loading report
    (``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)``)."""
    problems = []
    for key, ckpt_shape, model_shape in sorted(info.get("mismatched_keys", ())):
        problems.append(Problem(f"tensor '{key}' has shape {tuple(ckpt_shape)} in the checkpoint but the model "
                                f"expects {tuple(model_shape)}", key))
    for key in sorted(info.get("missing_keys", ())):
        problems.append(Problem(f"tensor '{key}' is missing from the checkpoint", key))
    problems += unexpected_problems(info.get("unexpected_keys", ()))
    raise_for_problems(path, problems)


def unexpected_problems(keys) -> list[Problem]:
    """Checkpoint tensors the model would silently drop, as one problem (training would lose them on save)."""
    keys = sorted(keys)
    if not keys:
        return []
    shown = shorten((f"'{k}'" for k in keys), 3)
    return [Problem(f"checkpoint tensor(s) {shown} belong to no tensor of the model, which would drop them (does "
                    "config.json describe this checkpoint? is it the checkpoint of another model class?)")]


# from_pretrained keyword arguments that mean the same to from_config: passed on when building the skeleton.
INIT_KWARGS = ("attn_implementation", "experts_implementation")
# Keyword arguments that only say how or where a full load puts the weights: placement is wrap_model's job
# (adapter_kwargs only matter for a directory holding a PEFT adapter, which stream_blocker refuses).
PLACEMENT_KWARGS = ("device_map", "low_cpu_mem_usage", "trust_remote_code", "dtype", "torch_dtype", "adapter_kwargs")


def init_kwargs(kwargs: dict) -> dict:
    """The ``from_pretrained`` keyword arguments that apply to a model built from its config."""
    return {k: kwargs[k] for k in INIT_KWARGS if k in kwargs}


def stream_blocker(path: str, config, kwargs: dict) -> str | None:
    """Why the checkpoint in ``path`` cannot be streamed region by region, or None if it can."""
    # (empty values say nothing; names with a leading underscore are transformers' own bookkeeping,
    # e.g. _from_auto when an auto class calls the concrete class)
    others = sorted(k for k, v in kwargs.items()
                    if k not in INIT_KWARGS + PLACEMENT_KWARGS and not k.startswith("_") and v not in (None, False)
                    and not (isinstance(v, (dict, list, tuple, str)) and not v))
    if others:
        return f"from_pretrained was given {others}, which only a full load understands"
    if getattr(config, "auto_map", None):
        return "the model has custom code (config.json has an auto_map)"
    if not checkpoint_files(path):
        return "it has no safetensors files (model.safetensors or model.safetensors.index.json)"
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return "it holds a PEFT adapter, which transformers attaches to its base model on a full load"
    return None


def open_streaming_model(path: str, config, dtype: torch.dtype, model_class=None, *,
                         quantized_base: QuantizedBase = QuantizedBase.DEQUANTIZE, **init_kwargs):
    """The model of ``path`` with placeholders for its weights, checked against the checkpoint's headers.

    Reads config and headers only. Raises :class:`CheckpointError` naming every
    missing, unexpected or wrong-shaped tensor, by checkpoint key.
    """
    # A format we do not serve is refused here, before any read, with the fix that fits quantized_base.
    fmt = quant_format(config, quantized_base=quantized_base)
    drop_quantization_config(config)
    model = mark_quantized_release(build_meta_model(model_class or model_class_for(config), config, dtype,
                                                    **init_kwargs), fmt is not None)
    index = SafetensorsIndex.from_directory(path)
    if fmt is not None:  # a quantized release: read as the checkpoint of its dequantized values
        index = QuantizedIndex(index, fmt, model)
    layout = CheckpointLayout(index, model, path)
    install_placeholders(model, layout)
    set_weight_conversions(model, layout.rules)  # as from_pretrained does: saving reverses the rules that matched
    keys = {t.key for t in list(model.parameters()) + list(model.buffers()) if isinstance(t, CheckpointTensor)}
    raise_for_problems(path, layout.problems(sorted(keys)) + unexpected_problems(layout.unexpected_keys()))
    return model


def open_on_this_rank(path: str, config, dtype: torch.dtype, *, topology, stream: bool,
                      full_load: Callable[[], nn.Module], model_class=None, kwargs: dict | None = None,
                      blocker: str | None = None,
                      quantized_base: QuantizedBase = QuantizedBase.DEQUANTIZE) -> nn.Module:
    """memory_efficient_init's model on this rank, from the checkpoint in ``path`` (``NativeFSDPStrategy.from_pretrained``
    and the swift plugin both load through here).

    A rank that is not its node's source builds the model on meta from ``config``. The source streams
    (:func:`open_streaming_model`: headers only now, its node's rows in ``wrap_model``) unless ``stream`` is False,
    the caller names a ``blocker``, or :func:`stream_blocker` finds one; then ``full_load()`` loads it whole.
    ``quantized_base=keep`` needs the stream for a quantized release (a whole load dequantizes it), so a blocker
    is then refused.
    """
    kwargs = kwargs or {}
    if not topology.is_source:
        return meta_skeleton(config, dtype, model_class=model_class, **init_kwargs(kwargs))
    if blocker is None:
        blocker = stream_blocker(path, config, kwargs) if stream else "stream_checkpoint=False"
    if blocker is not None and QuantizedBase(quantized_base) == QuantizedBase.KEEP \
            and getattr(config, "quantization_config", None):
        raise CheckpointError(
            f"quantized_base=keep: {path} cannot be streamed ({blocker}), and keep holds only what the streamed "
            "init sends as stored; remove that cause, or set quantized_base=dequantize")
    if blocker is None:
        logger.info("memory_efficient_init: node %d streams %s: wrap_model reads only the rows this node keeps",
                    topology.node_index, path)
        return open_streaming_model(path, config, dtype, model_class=model_class, quantized_base=quantized_base,
                                    **init_kwargs(kwargs))
    logger.info("memory_efficient_init: node %d loads %s whole in host memory (%s)", topology.node_index, path, blocker)
    return full_load()


def meta_skeleton(config, dtype: torch.dtype, model_class=None, **init_kwargs):
    """The same model with meta placeholders: what ranks that never read the checkpoint build."""
    drop_quantization_config(config)  # the weights arrive dequantized: every rank builds the plain model
    return install_placeholders(build_meta_model(model_class or model_class_for(config), config, dtype,
                                                 **init_kwargs))


def share_weight_conversions(model: nn.Module, topology, node_group) -> None:
    """Give every rank of the node the conversion rules its source loaded the checkpoint with (collective),
    and whether it streams a quantized release (then the init agrees on what travels quantized).

    ``from_pretrained`` records the rules that matched on the model (``_weight_conversions``), and saving
    reverses them (the checkpoint is written back in its own key layout). Ranks that built the model
    from the config alone learn them here, so that every rank plans the same files.
    """
    mine = (weight_conversions(model), is_quantized_release(model)) if topology.is_source else None
    rules, quantized = broadcast_from_source(mine, topology.source_rank, node_group)
    if rules is not None:
        set_weight_conversions(model, rules)
    mark_quantized_release(model, quantized)
