"""LoRA on the fused experts of any tiny family, as tests/unit/test_lora_experts.py and tests/workers/lora_experts.py
put it: PEFT's ``target_parameters`` on every 3-D expert tensor, attention's o_proj too."""

from __future__ import annotations

import torch
from torch import nn

LORA_SEED = 7


def expert_lora_targets(model: nn.Module) -> list[str]:
    """PEFT ``target_parameters`` naming each experts module's fused tensors: ``<block>.experts.<tensor>``."""
    found = set()
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and experts in module.children():
            block = name.rsplit(".", 1)[-1]
            found.update(f"{block}.experts.{attr}" for attr, p in experts.named_parameters(recurse=False)
                         if p.dim() == 3)
    return sorted(found)


def with_expert_lora(model: nn.Module, *, seed: int = LORA_SEED, **options):
    """``model`` with a fresh LoRA adapter on its experts and o_proj, the same for a seed (B random too, so a
    wrong expert's slice of the adapter changes the outputs)."""
    from peft import LoraConfig, get_peft_model

    config = dict(r=2, lora_alpha=4, target_modules=["o_proj"], target_parameters=expert_lora_targets(model),
                  init_lora_weights=False)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(**{**config, **options}))
