"""The changes that make a plan fit, each re-planned: ep_size, sequence_parallel_size, activation
checkpointing, quantized_base=keep, a smaller micro-batch, more nodes. Each is named as the Python API names
it (a StrategyConfig field or a PlanRequest argument); the front-ends spell it their way (``Fix.spelled``)."""

from __future__ import annotations

import dataclasses

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.planning.plan import Fix, MemoryPlan, plan_once
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.skeleton import PlannedModel


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A change to try: ``option`` (as the Python API names it) set to ``value``, and the request it makes."""

    option: str
    value: object
    request: PlanRequest
    note: str = ""


def candidate_changes(request: PlanRequest, planned: PlannedModel) -> list[Candidate]:
    strategy, dims, out = request.strategy, planned.dims, []
    if planned.blocks:
        experts = planned.blocks[0].num_experts
        bigger = [ep for ep in range(dims.ep_size + 1, dims.world_size + 1)
                  if dims.world_size % ep == 0 and experts % ep == 0]
        if bigger:
            out.append(Candidate("ep_size", bigger[0], request.replace(strategy=strategy.replace(ep_size=bigger[0]))))
    heads = getattr(planned.config.get_text_config(), "num_attention_heads", 0) or 0
    sp = dims.sp_size * 2
    if heads and heads % sp == 0 and dims.world_size % sp == 0:
        out.append(Candidate("sequence_parallel_size", sp,
                             request.replace(strategy=strategy.replace(sequence_parallel_size=sp))))
    if not request.gradient_checkpointing:
        out.append(Candidate("gradient_checkpointing", True, request.replace(gradient_checkpointing=True)))
    if planned.quantized is not None and strategy.quantized_base != "keep":
        keep = strategy.replace(quantized_base="keep", memory_efficient_init=True, stream_checkpoint=True)
        out.append(Candidate("quantized_base", "keep", request.replace(strategy=keep)))
    if request.micro_batch > 1:
        # The library's word is PlanRequest's micro_batch; each front-end spells it (per_device_train_batch_size).
        half = request.micro_batch // 2
        out.append(Candidate("micro_batch", half, request.replace(micro_batch=half),
                             note="double the gradient accumulation"))
    out.append(Candidate("nnodes", request.nnodes * 2, request.replace(nnodes=request.nnodes * 2)))
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
    for candidate in candidate_changes(plan.request, planned):
        try:
            changed = plan_memory(candidate.request, fixes=False)
        except TwinkleError:
            continue  # a change the sizes refuse is no fix
        fixes.append(Fix(option=candidate.option, value=candidate.value, peak=changed.peak, fits=changed.fits,
                         note=candidate.note))
    return tuple(sorted(fixes, key=lambda f: (not f.fits, f.peak)))
