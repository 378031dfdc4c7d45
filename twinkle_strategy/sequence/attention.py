"""Ulysses attention: the model's own attention function, run on the whole sequence for a share of the heads.

Every transformers family computes its projections, norms and RoPE in its attention module and then
calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, **kwargs)``.
:func:`apply_sequence_parallel` registers one more such function (transformers' public
``AttentionInterface.register``) and switches the model to it. That function exchanges q/k/v from
[sequence chunk, all heads] to [whole sequence, heads / sp], calls the implementation the model was
loaded with (sdpa, flash attention, flex), and exchanges the output back. So GQA, MLA (DeepSeek-V3:
k/v head dims differ, which the exchange does not care about) and every family's RoPE keep working.

The mask: the model only sees its chunk, so the mask it would build is the wrong size. Our function's
name is not in transformers' mask registry, so the model builds none (transformers skips masks for
such "custom" attention functions) and we build the whole sequence's mask here, with transformers'
own ``create_causal_mask`` from the global position ids: packed sequences (position ids that restart
at 0) get its block-diagonal causal mask, plain sequences get none (sdpa's ``is_causal``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from twinkle_strategy.compat.transformers_internals import attention_implementation, config_with_attention
from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.sequence.exchange import gather_sequence, heads_to_sequence, sequence_to_heads

# transformers 5.24 renamed the mask functions' KV-cache argument from ``past_key_values`` to ``cache``
# (the same rename as the decoder layers'); setup.py allows both sides of it.
_MASK_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

_NAME_PREFIX = "twinkle_ulysses_"


@dataclasses.dataclass
class _LastMask:
    """The mask of the last call, reused while the global position ids stay the same (every layer of a forward)."""

    positions: torch.Tensor | None = None
    sliding_window: int | None = None
    mask: object = None


class UlyssesAttention:
    """The attention function registered for one model: ``inner`` is the implementation it was loaded with."""

    def __init__(self, *, group, inner: str, config) -> None:
        from transformers import AttentionInterface

        self.group = group
        self.sp = torch.distributed.get_world_size(group)
        self.inner_name = inner
        self.inner = AttentionInterface()[inner]
        # The model's config as the inner implementation sees it, for building its masks.
        self.mask_config = config_with_attention(config, inner)
        self._last = _LastMask()

    @property
    def name(self) -> str:
        return _NAME_PREFIX + self.inner_name

    def __call__(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "sinks", None) is not None:
            raise ModelStructureError(f"{type(module).__name__} has attention sinks, which sequence parallelism "
                                      "cannot split by heads yet; use sequence_parallel_size=1")
        key, value = self._replicate_kv_heads(key), self._replicate_kv_heads(value)
        query, key, value = (sequence_to_heads(t, self.group) for t in (query, key, value))
        positions = kwargs.get("position_ids")
        if positions is None:  # without them packed rows would silently attend across examples
            raise ModelStructureError(f"{type(module).__name__} does not pass position_ids to its attention "
                                      "function, which sequence parallelism needs to find where packed examples "
                                      "start; use sequence_parallel_size=1 for this family")
        positions = gather_sequence(positions.expand(query.shape[0], -1), self.group)
        kwargs["position_ids"] = positions  # flash attention finds packed sequences from them
        if attention_mask is None:
            attention_mask = self._mask(query, positions, kwargs.get("sliding_window"))
        output, _ = self.inner(_with_head_groups(module, query, key), query, key, value, attention_mask, **kwargs)
        return heads_to_sequence(output, self.group), None

    def _replicate_kv_heads(self, states: torch.Tensor) -> torch.Tensor:
        """GQA with KV heads not divisible by sp: repeat each KV head so that every rank gets whole ones."""
        heads = states.shape[1]
        if heads % self.sp == 0:
            return states
        return states.repeat_interleave(self.sp // math.gcd(heads, self.sp), dim=1)

    def _mask(self, query: torch.Tensor, positions: torch.Tensor, sliding_window: int | None):
        last = self._last
        if (last.positions is not None and last.sliding_window == sliding_window
                and last.positions.shape == positions.shape and torch.equal(last.positions, positions)):
            return last.mask
        build = create_sliding_window_causal_mask if sliding_window else create_causal_mask
        batch, sequence = query.shape[0], query.shape[2]
        shape_only = query.new_zeros(()).expand(batch, sequence, 1)  # the mask functions read shape, dtype, device
        no_cache = {_MASK_CACHE_ARGUMENT: None}
        mask = build(config=self.mask_config, inputs_embeds=shape_only, attention_mask=None, position_ids=positions,
                     **no_cache)
        self._last = _LastMask(positions, sliding_window, mask)
        return mask


class _HeadGroups:
    """``module`` as the inner attention function should see it when KV heads were replicated.

    transformers' sdpa reads ``module.num_key_value_groups`` (query heads per KV head) to repeat KV
    heads itself; after replication that ratio is smaller. Every other attribute is the module's own.
    """

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _with_head_groups(module: nn.Module, query: torch.Tensor, key: torch.Tensor):
    groups = query.shape[1] // key.shape[1]
    return module if getattr(module, "num_key_value_groups", groups) == groups else _HeadGroups(module, groups)


def apply_sequence_parallel(model: nn.Module, group) -> UlyssesAttention:
    """Switch ``model``'s attention to Ulysses over ``group`` (every rank of the group calls this)."""
    from transformers import AttentionInterface

    inner = attention_implementation(model.config)
    if inner not in AttentionInterface():
        raise ModelStructureError(
            f"sequence parallelism wraps a registered attention function (sdpa, flash_attention_2, "
            f"flex_attention); {type(model).__name__} uses attn_implementation={inner!r}: load it with "
            "attn_implementation='sdpa'")
    attention = UlyssesAttention(group=group, inner=inner, config=model.config)
    AttentionInterface.register(attention.name, attention)
    model.set_attn_implementation(attention.name)
    return attention
