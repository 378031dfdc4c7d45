"""How each router family weights the experts it chose, so a replay can weight experts it did not choose.

Routing replay dispatches recorded expert ids instead of the router's top-k. The combine weights must
still come from the current router's scores at those ids, normalised as the family normalises them,
or the router gets no gradient (Megatron-LM's ``RouterReplay``). A :class:`RouterRule` is that
normalisation, written for one family of transformers router classes whose ``forward`` is the same
code (transformers copies it between models; tests/unit/test_rl_units.py checks the copies still match).

A router is called as ``router(hidden_states)`` and returns ``(router_logits, weights, indices)``;
the rules read the logits the router itself returned, so its linear layer (with LoRA, with FSDP's
unsharded weight) is the model's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn


def _softmax_top_k(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # Qwen2/3-MoE, OLMoE, Qwen3-Next ...: softmax over all experts (float32), the top-k renormalised when
    # norm_topk_prob (Qwen3.5-MoE and Qwen3-VL-MoE always renormalise and have no such attribute).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
    if getattr(router, "norm_topk_prob", True):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _sigmoid_top_k(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V3, GLM-4-MoE, Nemotron-H ...: sigmoid scores (the correction bias and the group limits only
    # pick the experts; the weights are the plain scores), renormalised when norm_topk_prob, then scaled.
    scores = logits.float().sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores * router.routed_scaling_factor


def _softmax_of_chosen(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # gpt-oss: softmax over the chosen experts' logits only.
    return torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)


@dataclasses.dataclass(frozen=True)
class RouterRule:
    """The combine weights a router family gives experts ``ids`` [rows, k] from its ``logits`` [rows, E]."""

    name: str
    weights_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    classes: tuple[str, ...]  # the transformers router classes whose forward is this rule's code

    def weights(self, router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
        """The weights, in the dtype of the router's own weights ``like``."""
        return self.weights_of(router, logits, ids).to(like.dtype)


RULES = (
    RouterRule("softmax, top-k renormalised", _softmax_top_k, (
        "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter",
        "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen3_5MoeTopKRouter",
        "Qwen3OmniMoeTextTopKRouter", "Qwen3VLMoeTextTopKRouter", "MixtralTopKRouter", "MiniMaxTopKRouter")),
    RouterRule("sigmoid with correction bias and group limits", _sigmoid_top_k, (
        "DeepseekV3TopkRouter", "DeepseekV32TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter",
        "Glm4vMoeTextTopkRouter", "Dots1TopkRouter", "NemotronHTopkRouter", "KimiLinearTopkRouter",
        "SolarOpenTopkRouter", "ExaoneMoeTopkRouter", "MiMoV2FlashTopkRouter", "GlmMoeDsaTopkRouter")),
    RouterRule("softmax of the chosen logits", _softmax_of_chosen, ("GptOssTopKRouter",)),
)
_RULE_OF_CLASS = {name: rule for rule in RULES for name in rule.classes}


def rule_for(router: nn.Module) -> RouterRule | None:
    """The rule of ``router``'s class, or None for a router replay cannot force (hash routing, Llama-4 ...).

    Read along the class's bases: FSDP2 swaps the class of a module it shards on its own (a router kept in
    float32 under bf16) for a subclass, ``FSDP<name>``."""
    for cls in type(router).__mro__:
        rule = _RULE_OF_CLASS.get(cls.__name__)
        if rule is not None:
            return rule
    return None


def find_router(block: nn.Module) -> nn.Module | None:
    """The child of an MoE block that picks its experts: one whose class has a rule, else one named like a
    router (so a refusal can name it), else None."""
    children = list(block.named_children())
    known = [module for _, module in children if rule_for(module) is not None]
    if known:
        return known[0]
    for name, module in children:
        if name in ("gate", "router") or type(module).__name__.endswith(("Router", "Gate")):
            return module
    return None
