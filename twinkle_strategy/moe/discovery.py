"""Finding the MoE blocks and expert tensors of a transformers v5 model.

An MoE block is a module with an ``experts`` child; the block's router picks
the experts and the block calls ``experts`` with its choices. Which calls and
weight layouts we serve is :mod:`twinkle_strategy.moe.contracts`'s business:
every ``experts`` child must match one, or discovery raises naming it, so a
model is either served whole or refused at ``wrap_model`` (never half-split).
We recognise the contract, not class names, so new families with a known
contract work unchanged.

PEFT's ``target_parameters`` wraps the experts module in nested
``ParamWrapper``s, each adding a ``lora_A``/``lora_B`` pair for one fused
parameter; those pairs are expert tensors too.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.contracts import ExpertsContract, read_contract
from twinkle_strategy.moe.expert_axis import ExpertAxis

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
    contract: ExpertsContract
    tensors: list[ExpertTensor]

    @property
    def num_experts(self) -> int:
        """Routed experts, the ones EP splits (LongCat-Flash's zero-computation experts are not counted)."""
        return self.contract.num_experts

    @property
    def experts_fqn(self) -> str:
        return f"{self.name}.{EXPERTS_ATTR}" if self.name else EXPERTS_ATTR


def _expert_tensors(experts_fqn: str, outer: nn.Module, contract: ExpertsContract) -> list[ExpertTensor]:
    num = contract.num_experts
    inner, wrappers = unwrap_experts(outer)
    found: list[ExpertTensor] = []
    prefix = experts_fqn
    for wrapper in wrappers:
        # A LoRA pair has one block per expert slot of the parameter it wraps
        # (LongCat-Flash's gate_up_proj: routed + zero-computation experts).
        zero = wrapper.num_experts - num
        for adapter, lora_a in wrapper.lora_A.items():
            lora_b = wrapper.lora_B[adapter]
            rank = wrapper.r[adapter]
            # lora_A is [E*r, in], expert-major; lora_B is [out, r*E], expert index fastest.
            found.append(ExpertTensor(lora_a, "weight", ExpertAxis(0, num, 1, rank, zero),
                                      f"{prefix}.lora_A.{adapter}.weight"))
            found.append(ExpertTensor(lora_b, "weight", ExpertAxis(1, num, rank, 1, zero),
                                      f"{prefix}.lora_B.{adapter}.weight"))
            if getattr(lora_b, "bias", None) is not None:
                raise ModelStructureError(f"{prefix}: LoRA bias on expert parameters cannot be split across EP ranks")
        prefix = f"{prefix}.base_layer"
    for attr, param in inner.named_parameters(recurse=False):
        # read_contract checked that dim 0 holds the routed experts, plus the zero-computation ones for some.
        zero = param.shape[0] - num
        found.append(ExpertTensor(inner, attr, ExpertAxis(0, num, zero_experts=zero), f"{prefix}.{attr}"))
    return found


def model_family(model: nn.Module) -> str:
    """How errors name the model: its class and transformers ``model_type``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    base = getattr(model, "get_base_model", lambda: model)()
    return f"{type(base).__name__} (model_type '{model_type}')" if model_type else type(base).__name__


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every module with an ``experts`` child, in module order, with the contract it is called by.

    Raises :class:`ModelStructureError` for an ``experts`` child whose contract we do not serve.
    """
    family = model_family(model)
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, EXPERTS_ATTR, None)
        if not isinstance(experts, nn.Module) or experts not in module.children():
            continue
        experts_fqn = f"{name}.{EXPERTS_ATTR}" if name else EXPERTS_ATTR
        inner, _ = unwrap_experts(experts)
        contract = read_contract(experts_fqn, module, inner, EXPERTS_ATTR, family)
        blocks.append(MoEBlock(name, module, experts, contract, _expert_tensors(experts_fqn, experts, contract)))
    return blocks
