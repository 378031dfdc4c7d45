"""A loaded model wrapped for training: ``NativeFSDPStrategy.wrap_model`` without routing replay.

In order: refuse a model expert or sequence parallelism cannot serve (the same answer on every rank, before any
collective); under memory_efficient_init, keep the source's loaded tensors by reference and move the model to meta,
so that EP and FSDP run identically on every rank; make LoRA on fused experts compute on the activations
(:mod:`twinkle_strategy.moe.lora_experts`, unless ``lora_experts: peft``); cut the experts (:mod:`twinkle_strategy.moe`), shard
(:mod:`twinkle_strategy.fsdp`); under memory_efficient_init, allocate this rank's shards and fill them from the
node's source (:mod:`twinkle_strategy.init`); split the attention for sequence parallelism
(:mod:`twinkle_strategy.sequence`); point the optimizer at the sharded parameters.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from twinkle_strategy.config import LoraExperts, StrategyConfig
from twinkle_strategy.distributed.node import NodeLink
from twinkle_strategy.errors import CallOrderError
from twinkle_strategy.fsdp import apply_fsdp, mixed_precision_policy, rebind_optimizer
from twinkle_strategy.init.capture import (
    Capture,
    buffer_alias_groups,
    capture_state,
    move_to_meta,
    restore_buffer_aliases,
)
from twinkle_strategy.init.engine import InitReport, distribute
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan, apply_expert_parallel, plan_expert_parallel
from twinkle_strategy.moe.lora_experts import compute_lora_on_activations
from twinkle_strategy.placement.process import ProcessPlace
from twinkle_strategy.sequence import apply_sequence_parallel, check_sequence_parallel, refuse_generation

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WrappedModel:
    """What wrapping leaves besides the model, which is wrapped in place."""

    optimizer: torch.optim.Optimizer | None  # the given optimizer, pointed at the sharded parameters
    ep_plan: ExpertParallelPlan | None  # the experts each rank keeps; None without expert parallelism
    init_report: InitReport | None  # what the memory-efficient init did on this rank; None without it


def wrap_for_training(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, place: ProcessPlace,
               config: StrategyConfig) -> WrappedModel:
    """Apply EP and FSDP2 (and SP) to ``model`` in place (collective); see ``NativeFSDPStrategy.wrap_model``."""
    dims, rank = place.dims, place.env.rank
    check_sequence_parallel(model.config, dims.sp_size)  # the same answer on every rank
    if dims.ep_enabled:
        # Refuse a model EP cannot serve before touching it: the same error on every rank,
        # raised before any collective (every rank holds the same model structure).
        plan_expert_parallel(model, dims, rank)
    names_by_param = {id(p): n for n, p in model.named_parameters()}
    capture = None
    if config.memory_efficient_init:
        # The source keeps references to its loaded tensors, then joins the
        # other ranks on meta: EP and FSDP run identically everywhere.
        capture = capture_state(model) if place.topology.is_source else None
        move_to_meta(model)
    elif any(p.is_meta for p in model.parameters()):
        raise CallOrderError("wrap_model got a model on the meta device; load it with strategy.from_pretrained "
                         "or set memory_efficient_init=True")
    if config.lora_experts == LoraExperts.ACTIVATIONS:
        # Before EP: its class is swapped on top, so it dispatches and the local experts compute LoRA this way.
        compute_lora_on_activations(model)
    ep_plan = None
    experts_modules: list[nn.Module] = []
    if dims.ep_enabled:
        ep_plan = apply_expert_parallel(model, dims, rank, ep_group=place.meshes.ep_group)
        experts_modules = [model.get_submodule(name) for name in ep_plan.experts_modules]
    policy = mixed_precision_policy(config.mixed_precision, reduce_dtype=config.reduce_dtype)
    apply_fsdp(model, place.meshes, experts_modules, policy, reshard_after_forward=config.reshard_after_forward)
    init_report = None
    if config.memory_efficient_init:
        init_report = _materialize(model, capture, ep_plan=ep_plan, place=place, config=config)
    if dims.sp_enabled:
        apply_sequence_parallel(model, place.meshes.sp_group)
        refuse_generation(model, dims.sp_size)
    if optimizer is not None:
        optimizer = rebind_optimizer(optimizer, names_by_param, model)
    return WrappedModel(optimizer=optimizer, ep_plan=ep_plan, init_report=init_report)


def _materialize(model: nn.Module, capture: Capture | None, *, ep_plan: ExpertParallelPlan | None,
                 place: ProcessPlace, config: StrategyConfig) -> InitReport:
    """Allocate this rank's shards and fill them from its node's source (collective); logs the init's line."""
    aliases = buffer_alias_groups(model)
    model.to_empty(device=place.device)  # allocates this rank's shards only
    restore_buffer_aliases(aliases)
    is_main_process = place.env.rank == 0
    try:
        report = distribute(
            model, capture, ep_plan=ep_plan, node=NodeLink(place.topology, place.node_group, place.device),
            bucket_bytes=config.init_bucket_bytes, transport_kind=config.init_transport,
            verify=config.verify_init, show_progress=is_main_process, quantized_base=config.quantized_base,
        )
    finally:
        if capture is not None:
            capture.release()
    if is_main_process:
        logger.info(report.log_line())
    return report
