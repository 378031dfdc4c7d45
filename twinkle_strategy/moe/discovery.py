"""Finding the MoE blocks and expert tensors of a transformers v5 model.

Transformers v5 MoE families (Qwen2/Qwen3-MoE, Mixtral, DeepSeek-V3, ...) share
one shape: a block with a router (``gate``) and an ``experts`` module holding
fused 3-D parameters ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``,
called as ``experts(hidden_states, top_k_index, top_k_weights)``. PEFT's
``target_parameters`` wraps that module in nested ``ParamWrapper``s, each adding
a ``lora_A``/``lora_B`` pair for one fused parameter. We recognise the structure,
not the class names, so new families with the same contract work unchanged.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from twinkle_strategy.moe.layout import ExpertAxis

EXPERTS_ATTR = "experts"


def _param_wrapper_class():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # peft missing or too old for target_parameters
        return None
    return ParamWrapper


def unwrap_experts(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """Return (the innermost experts module, the PEFT ParamWrappers around it, outermost first)."""
    wrapper_cls = _param_wrapper_class()
    wrappers = []
    while wrapper_cls is not None and isinstance(module, wrapper_cls):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def _is_fused_experts(module: nn.Module) -> bool:
    inner, _ = unwrap_experts(module)
    num = getattr(inner, "num_experts", None)
    weights = [getattr(inner, name, None) for name in ("gate_up_proj", "down_proj")]
    if not isinstance(num, int) or any(w is None for w in weights):
        # Before EP the innermost module holds the tensors directly; during a
        # PEFT forward they sit behind a parametrization, which we never see here.
        return False
    return all(w.dim() == 3 and w.shape[0] == num for w in weights)


@dataclasses.dataclass
class ExpertTensor:
    """One tensor that holds experts: its owner module, attribute name and expert axis."""

    module: nn.Module
    attr: str
    axis: ExpertAxis
    fqn: str  # name relative to the model passed to find_moe_blocks


@dataclasses.dataclass
class MoEBlock:
    name: str  # fqn of the block (parent of ``experts``)
    block: nn.Module
    experts: nn.Module  # outermost module at ``block.experts`` (PEFT wrapper or the experts themselves)
    num_experts: int
    tensors: list[ExpertTensor]

    @property
    def experts_fqn(self) -> str:
        return f"{self.name}.{EXPERTS_ATTR}" if self.name else EXPERTS_ATTR


def _expert_tensors(experts_fqn: str, outer: nn.Module, num_experts: int) -> list[ExpertTensor]:
    inner, wrappers = unwrap_experts(outer)
    found: list[ExpertTensor] = []
    prefix = experts_fqn
    for wrapper in wrappers:
        for adapter, lora_a in wrapper.lora_A.items():
            lora_b = wrapper.lora_B[adapter]
            rank = wrapper.r[adapter]
            # lora_A is [E*r, in], expert-major; lora_B is [out, r*E], expert index fastest.
            found.append(
                ExpertTensor(lora_a, "weight", ExpertAxis(0, num_experts, 1, rank), f"{prefix}.lora_A.{adapter}.weight")
            )
            found.append(
                ExpertTensor(lora_b, "weight", ExpertAxis(1, num_experts, rank, 1), f"{prefix}.lora_B.{adapter}.weight")
            )
            if getattr(lora_b, "bias", None) is not None:
                raise ValueError(f"{prefix}: LoRA bias on expert parameters cannot be split across EP ranks")
        prefix = f"{prefix}.base_layer"
    for attr, param in inner.named_parameters(recurse=False):
        if param.dim() >= 1 and param.shape[0] == num_experts:
            found.append(ExpertTensor(inner, attr, ExpertAxis(0, num_experts), f"{prefix}.{attr}"))
    return found


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every module whose ``experts`` child is a fused-experts module, in module order."""
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, EXPERTS_ATTR, None)
        if not isinstance(experts, nn.Module) or experts not in module.children():
            continue
        if not _is_fused_experts(experts):
            continue
        inner, _ = unwrap_experts(experts)
        num = inner.num_experts
        experts_fqn = f"{name}.{EXPERTS_ATTR}" if name else EXPERTS_ATTR
        blocks.append(MoEBlock(name, module, experts, num, _expert_tensors(experts_fqn, experts, num)))
    return blocks
