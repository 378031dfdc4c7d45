"""The changes that make a plan fit, each re-planned: ep_size, sequence_parallel_size, activation
checkpointing, quantized_base=keep, a smaller micro-batch, more nodes."""

from __future__ import annotations

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.planning.plan import Fix, MemoryPlan, plan_once
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.skeleton import PlannedModel


def candidate_changes(request: PlanRequest, planned: PlannedModel) -> list[tuple[str, PlanRequest]]:
    strategy, dims, out = request.strategy, planned.dims, []
    if planned.blocks:
        experts = planned.blocks[0].num_experts
        bigger = [ep for ep in range(dims.ep_size + 1, dims.world_size + 1)
                  if dims.world_size % ep == 0 and experts % ep == 0]
        if bigger:
            out.append((f"ep_size={bigger[0]}", request.replace(strategy=strategy.replace(ep_size=bigger[0]))))
    heads = getattr(planned.config.get_text_config(), "num_attention_heads", 0) or 0
    sp = dims.sp_size * 2
    if heads and heads % sp == 0 and dims.world_size % sp == 0:
        out.append((f"sequence_parallel_size={sp}",
                    request.replace(strategy=strategy.replace(sequence_parallel_size=sp))))
    if not request.gradient_checkpointing:
        out.append(("gradient_checkpointing=True", request.replace(gradient_checkpointing=True)))
    if planned.quantized is not None and strategy.quantized_base != "keep":
        keep = strategy.replace(quantized_base="keep", memory_efficient_init=True, stream_checkpoint=True)
        out.append(("quantized_base='keep'", request.replace(strategy=keep)))
    if request.micro_batch > 1:
        half = request.micro_batch // 2
        out.append((f"per_device_train_batch_size={half} (double the gradient accumulation)",
                    request.replace(micro_batch=half)))
    out.append((f"nnodes={request.nnodes * 2}", request.replace(nnodes=request.nnodes * 2)))
    return out


def plan_memory(request: PlanRequest, *, fixes: bool = True) -> MemoryPlan:
    """The plan of ``request``; when it does not fit its budget, with the changes that make it fit, ranked."""
    plan, planned = plan_once(request)
    if fixes and plan.fits is False:
        plan = plan.with_fixes(ranked_fixes(plan, planned))
    return plan


def ranked_fixes(plan: MemoryPlan, planned: PlannedModel) -> tuple[Fix, ...]:
    """Each change re-planned; those that fit first, lowest peak first."""
    fixes = []
    for change, request in candidate_changes(plan.request, planned):
        try:
            changed = plan_memory(request, fixes=False)
        except TwinkleError:
            continue  # a change the sizes refuse is no fix
        fixes.append(Fix(change=change, peak=changed.peak, fits=changed.fits))
    return tuple(sorted(fixes, key=lambda f: (not f.fits, f.peak)))
