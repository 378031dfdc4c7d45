"""Expert parallelism and activation checkpointing as module classes (issue 44): names and contracts kept.

The modules keep their instance, parameters and parameter names (checkpoints, PEFT adapters and init plans
key on them), and their class name (transformers and our discovery find modules by it). EP's numerics are
checked against one process in tests/multiproc (test_foundation_multiproc, test_model_families, test_bf16).
"""

from __future__ import annotations

import pytest
import torch

from twinkle_strategy.moe.class_swap import unswapped_class
from twinkle_strategy.moe.contracts import CallKind
from twinkle_strategy.moe.discovery import find_moe_blocks, unwrap_experts
from twinkle_strategy.moe.expert_parallel import apply_expert_parallel
from twinkle_strategy.moe.parallel_experts import ExpertParallelExperts, PreRoutedExpertParallelExperts
from twinkle_strategy.moe.recompute import CheckpointedLayer, apply_activation_checkpointing
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.testing.tiny_models import build_tiny_model


def _with_lora(model, family):
    from peft import LoraConfig, get_peft_model

    prefix = "feed_forward" if family == "llama4" else "mlp"
    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[
        f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]))


@pytest.mark.parametrize("family,lora", [("qwen3_moe", False), ("qwen3_moe", True), ("llama4", False),
                                         ("llama4", True), ("longcat_flash", False)])
def test_expert_parallel_keeps_names_classes_and_contracts(family, lora):
    model = build_tiny_model(family)
    if lora:
        model = _with_lora(model, family)
    before = {b.experts_fqn: (type(b.experts), b.contract.kind) for b in find_moe_blocks(model)}
    names = [name for name, _ in model.named_parameters()]
    apply_expert_parallel(model, ParallelDims(world_size=2, ep_size=2), 1, ep_group=None)

    assert [name for name, _ in model.named_parameters()] == names
    after = find_moe_blocks(model)  # discovery runs again after wrap_model (expert load, FLOPs, replay)
    assert len(after) == len(before) > 0
    for block in after:
        cls, kind = before[block.experts_fqn]
        experts = block.experts
        mixin = PreRoutedExpertParallelExperts if kind == CallKind.PRE_ROUTED else ExpertParallelExperts
        assert isinstance(experts, mixin) and isinstance(experts, cls)
        assert type(experts).__name__ == cls.__name__ and unswapped_class(type(experts)) is cls
        assert block.contract.kind == kind
        inner, wrappers = unwrap_experts(experts)
        assert len(wrappers) == (2 if lora else 0)  # PEFT's wrappers are still found: the outermost was swapped
        assert experts.expert_parallel.num_local_experts == block.num_experts  # (discovery now counts local ones)
        assert "expert_parallel: " in repr(experts)


def test_activation_checkpointing_keeps_names_recomputes_in_training_only_and_is_idempotent():
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    names, layer_class = list(model.state_dict()), type(model.model.layers[0])

    apply_activation_checkpointing(list(model.model.layers))
    apply_activation_checkpointing(list(model.model.layers))
    layer = model.model.layers[0]
    assert isinstance(layer, CheckpointedLayer) and type(layer).__mro__[2] is layer_class  # one swap, not two
    assert type(layer).__name__ == layer_class.__name__ and list(model.state_dict()) == names
    calls = []
    layer.self_attn.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    model.zero_grad(set_to_none=True)
    checkpointed = model(input_ids=ids, labels=ids)
    checkpointed.loss.backward()
    assert calls == [True, True]  # the forward, then its recomputation in the backward
    assert torch.equal(checkpointed.loss, out.loss)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    calls.clear()
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == [False]  # evaluation: nothing to recompute
