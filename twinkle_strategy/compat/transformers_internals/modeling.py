"""What a model's forward calls: the attention implementation its config names (sequence parallelism wraps it)
and its family's MoE load-balancing loss function; what its experts modules compute with (their implementation,
their gate, transformers' own expert parallelism).
"""

from __future__ import annotations

import copy
import inspect
import sys

from torch import nn

from twinkle_strategy.compat.registry import Internal
from twinkle_strategy.compat.transformers_internals.checked import CHECKED, NO_PUBLIC_API

ATTN_IMPLEMENTATION = Internal(
    "PreTrainedConfig._attn_implementation", "transformers",
    used_for="read which attention function a model was loaded with (Ulysses wraps that one), and build the "
             "whole sequence's mask with a copy of the config that names it",
    checked=CHECKED,
    replacement="none for reading it (set_attn_implementation only sets it; the attention-interface docs read "
                "config._attn_implementation themselves)")


@ATTN_IMPLEMENTATION.wrapper
def attention_implementation(config) -> str | None:
    """The name of the attention function ``config``'s model calls (``"sdpa"``, ``"flash_attention_2"`` ...)."""
    return ATTN_IMPLEMENTATION.attribute(config, "_attn_implementation")


@ATTN_IMPLEMENTATION.wrapper
def config_with_attention(config, implementation: str):
    """A shallow copy of ``config`` whose models call ``implementation``: what transformers' mask functions read."""
    ATTN_IMPLEMENTATION.attribute(config, "_attn_implementation")
    changed = copy.copy(config)
    changed._attn_implementation = implementation
    return changed


BALANCING_LOSS_FUNCTION = Internal(
    "modeling_<family>.load_balancing_loss_func", "transformers",
    used_for="evaluate an MoE family's own load-balancing loss on given router logits (cast to fp32, and in their "
             "own dtype), to judge in bf16 as in fp32 whether it is the Switch-Transformer form counted over the "
             "global batch",
    checked="5.19, 5.24", replacement="none: the models compute it inside their forward only")

_BALANCING_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@BALANCING_LOSS_FUNCTION.wrapper
def balancing_loss_function(model: nn.Module):
    """The ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` that ``model``'s forward
    calls: a global of the modeling module of its class, or of the nearest base class whose module has one (a
    subclass defined elsewhere inherits its forward). None where none has one with those parameters (remote
    code, Switch-Transformers' own signature)."""
    for cls in type(model).__mro__:
        function = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if callable(function):
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):
                return None
            return function if tuple(parameters)[:4] == _BALANCING_PARAMETERS else None
    return None


EXPERTS_IMPLEMENTATION = Internal(
    "PreTrainedConfig._experts_implementation", "transformers",
    used_for="read which compute a model's experts dispatch to (eager, grouped_mm, batched_mm), so LoRA on the "
             "experts' activations computes grouped where the model's experts do",
    checked="5.19, 5.24", replacement="none for reading it (set_experts_implementation only sets it)")


@EXPERTS_IMPLEMENTATION.wrapper
def experts_implementation(config) -> str | None:
    """The experts implementation ``config``'s experts modules dispatch to (None for a config without one)."""
    return getattr(config, "_experts_implementation", None)


EXPERTS_GATE = Internal(
    "use_experts_implementation: Experts._apply_gate", "transformers",
    used_for="apply an experts family's own gate to its gate_up output (gpt-oss's interleaved, clamped one; "
             "the default act(gate) * up), as transformers' grouped_mm forward does",
    checked="5.19, 5.24", replacement=NO_PUBLIC_API)


@EXPERTS_GATE.wrapper
def experts_gate(experts: nn.Module):
    """``experts``'s gate (a bound method: gate_up [S, 2I] -> [S, I]), or None for a class transformers'
    ``@use_experts_implementation`` did not decorate."""
    return getattr(experts, "_apply_gate", None)


EXPERTS_EXPERT_PARALLEL = Internal(
    "use_experts_implementation: Experts._is_expert_parallel", "transformers",
    used_for="tell an experts module under transformers' own expert parallelism (sentinel rows past its experts), "
             "which LoRA on the activations leaves to PEFT's path",
    checked="5.19, 5.24", replacement=NO_PUBLIC_API)


@EXPERTS_EXPERT_PARALLEL.wrapper
def under_transformers_expert_parallel(experts: nn.Module) -> bool:
    """Whether transformers' own expert parallelism (its ``tp_plan``'s EP) drives ``experts``."""
    return bool(getattr(experts, "_is_expert_parallel", False))


PEFT_EXPERTS_ORIENTATION = Internal(
    "ParamWrapper._did_swap_in_out_features", "peft",
    used_for="read the orientation of PEFT's LoRA on a fused expert tensor ([E, out, in] swapped, or [E, in, out]), "
             "so LoRA on the experts' activations multiplies lora_A and lora_B as PEFT's get_delta_weight does",
    checked="0.20.0, 0.21.2",
    replacement="ParamWrapper.get_delta_factors (peft 0.21.2 on), used where it exists")


@PEFT_EXPERTS_ORIENTATION.wrapper
def lora_delta_factors(wrapper: nn.Module, adapter: str):
    """``(lhs [E, d1, r], rhs [E, r, d2], scaling)`` with PEFT's delta of ``adapter`` on ``wrapper``'s fused tensor
    [E, d1, d2] equal to ``scaling * lhs @ rhs`` (PEFT's ``ParamWrapper.get_delta_factors``; on PEFT versions
    without it, the same from ``get_delta_weight``'s layout: lora_A [E*r, in] expert-major, lora_B [out, r*E]
    expert index fastest)."""
    factors = getattr(wrapper, "get_delta_factors", None)
    if factors is not None:
        return factors(adapter)
    weight_a = wrapper.lora_A[adapter].weight
    weight_b = wrapper.lora_B[adapter].weight
    weight_a = weight_a.reshape(wrapper.num_experts, -1, weight_a.shape[-1])  # [E, r, in]
    weight_b = weight_b.reshape(weight_b.shape[0], -1, wrapper.num_experts).permute(2, 0, 1)  # [E, out, r]
    swapped = PEFT_EXPERTS_ORIENTATION.attribute(wrapper, "_did_swap_in_out_features")
    # get_delta_weight: "o r e, e r i -> e o i" when swapped (tensor [E, out, in]), else "-> e i o".
    lhs, rhs = (weight_b, weight_a) if swapped else (weight_a.transpose(-2, -1), weight_b.transpose(-2, -1))
    dtype = wrapper.get_param().dtype
    return lhs.to(dtype), rhs.to(dtype), wrapper.scaling[adapter]
