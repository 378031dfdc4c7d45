"""Packed rows on the model side: whether a model keeps packed examples apart, and preparing it for them.

A packed row holds several examples whose ``position_ids`` restart at 0 for each. transformers reads those
positions as packed sequences: its mask functions build a causal mask that stays inside each example (sdpa, eager,
flex), and flash attention gets per-example ``cu_seqlens``. Layers that carry state along the sequence (linear
attention, Mamba, short convolutions) ignore ``position_ids`` and would let one example leak into the next:
:func:`check_packable` refuses them by name. Used by twinkle's Trainer (``data.packing``) and by the transformers
layer (``DataCollatorWithFlattening``, TRL's and swift's padding-free batches).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

from torch import nn

from twinkle_strategy.errors import PackingError

# Decoder layer kinds (config.layer_types / layers_block_type) whose sequence mixing transformers masks
# from position_ids, or that do not mix tokens at all.
PACKABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention",
                                  "moe", "mlp"})


@dataclasses.dataclass(frozen=True)
class PackingOption:
    """How the caller's front-end names packed batches in a refusal: the option that asked for them, and how to
    turn it off. The library speaks of the batches themselves; twinkle-sft, swift and the HF layer pass their own."""

    name: str = "packed batches (position_ids restarting at every example)"
    turn_off: str = "give it one example per row instead (a padding collator, not DataCollatorWithFlattening)"


def prepare_for_packed_batches(model: nn.Module, *, option: PackingOption = PackingOption()) -> None:
    """Refuse a model whose layers mix packed examples (:func:`check_packable`), and turn its KV cache off.

    transformers builds per-example masks from ``position_ids`` only without a cache, and its causal LMs
    make a ``DynamicCache`` whenever ``config.use_cache`` is true (in training too): packed examples would
    then silently attend to each other. Training never reads the cache.
    """
    check_packable(model, option=option)
    for config in {id(c): c for c in (model.config, _text_config(model))}.values():
        config.use_cache = False


def _text_config(model: nn.Module):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def check_packable(model: nn.Module, *, option: PackingOption = PackingOption()) -> None:
    """Raise :class:`PackingError` naming the family and the reason if ``model`` cannot keep packed examples apart.

    Attention is masked per example by transformers from ``position_ids``, in the models whose forward hands
    ``position_ids`` to its mask functions (gpt-oss's does not, in transformers 5.24). Linear attention (Gated
    DeltaNet: Qwen3-Next, Qwen3.5-MoE), Mamba (Nemotron-H, Jamba) and short convolutions carry state from
    one token to the next regardless: transformers passes them per-example boundaries only through optional
    fused kernels, not by default. The check reads the config and the code, so it gives the same answer on
    every rank before training: every rank raises it and none waits for the others.
    """
    config = _text_config(model)
    family = getattr(config, "model_type", type(model).__name__)
    kinds = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "layers_block_type", None) or [])
    stateful = sorted(kinds - PACKABLE_LAYER_TYPES)
    convolution = next((name for name, m in model.named_modules() if isinstance(m, nn.Conv1d)), None)
    blind = next((cls for cls in {type(m) for m in model.modules()} if _builds_masks_without_positions(cls)), None)
    if stateful:
        why = f"its layers of type {stateful} mix tokens along the sequence outside the attention mask"
    elif convolution is not None:
        why = f"its convolution along the sequence ({convolution}) carries state from one token to the next"
    elif blind is not None:
        why = (f"{blind.__name__}.forward builds its attention masks without position_ids, so transformers cannot "
               "tell the packed examples apart")
    else:
        return
    raise PackingError(f"{option.name} cannot train {family}: {why}, and each packed example would see the ones "
                       f"before it; {option.turn_off}")


@functools.cache
def _builds_masks_without_positions(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' mask functions (``create_causal_mask(config=...,
    inputs_embeds=...)`` and kin) without ``position_ids``, the argument packed-sequence detection reads."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # no Python source (builtins, compiled): nothing to read
        return False
    mask_arguments = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            mask_arguments.append({k.arg for k in node.keywords})
        elif isinstance(node, ast.Dict):
            mask_arguments.append({k.value for k in node.keys if isinstance(k, ast.Constant)})
    mask_arguments = [names for names in mask_arguments if {"config", "inputs_embeds"} <= names]
    return bool(mask_arguments) and not any("position_ids" in names for names in mask_arguments)
