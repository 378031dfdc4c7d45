"""The changes that make a plan fit, each re-planned: ep_size, sequence_parallel_size, activation
checkpointing, quantized_base=keep, a smaller micro-batch, more nodes. Each is named as the Python API names
it (a StrategyConfig field or a PlanRequest argument); the front-ends spell it their way (``Fix.spelled``)."""

from __future__ import annotations

import dataclasses

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.planning.cache import PlanCache, measured_plan
from twinkle_strategy.planning.plan import Fix, MemoryPlan, ModelFacts
from twinkle_strategy.planning.request import PlanRequest


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A change to try: ``option`` (as the Python API names it) set to ``value``, and the request it makes."""

    option: str
    value: object
    request: PlanRequest
    note: str = ""


def candidate_changes(request: PlanRequest, facts: ModelFacts) -> list[Candidate]:
    strategy, out = request.strategy, []
    if facts.num_experts is not None:
        bigger = [ep for ep in range(facts.ep_size + 1, facts.world_size + 1)
                  if facts.world_size % ep == 0 and facts.num_experts % ep == 0]
        if bigger:
            out.append(Candidate("ep_size", bigger[0], request.replace(strategy=strategy.replace(ep_size=bigger[0]))))
    heads = facts.attention_heads
    sp = facts.sequence_parallel_size * 2
    if heads and heads % sp == 0 and facts.world_size % sp == 0:
        out.append(Candidate("sequence_parallel_size", sp,
                             request.replace(strategy=strategy.replace(sequence_parallel_size=sp))))
    if not request.gradient_checkpointing:
        out.append(Candidate("gradient_checkpointing", True, request.replace(gradient_checkpointing=True)))
    if facts.quantized and strategy.quantized_base != "keep":
        keep = strategy.replace(quantized_base="keep", memory_efficient_init=True, stream_checkpoint=True)
        out.append(Candidate("quantized_base", "keep", request.replace(strategy=keep)))
    if request.micro_batch > 1:
        # The library's word is PlanRequest's micro_batch; each front-end spells it (per_device_train_batch_size).
        half = request.micro_batch // 2
        out.append(Candidate("micro_batch", half, request.replace(micro_batch=half),
                             note="double the gradient accumulation"))
    out.append(Candidate("nnodes", request.nnodes * 2, request.replace(nnodes=request.nnodes * 2)))
    return out


def plan_memory(request: PlanRequest, *, fixes: bool = True, cache: PlanCache | None = None) -> MemoryPlan:
    """The plan of ``request``; when it does not fit its budget, with the changes that make it fit, ranked.

    ``cache``: answer from (and keep in) plans on disk, each re-planned fix too (:mod:`.cache`); the figures are
    those the model's trace gives, whichever way they come."""
    plan, facts = measured_plan(request, cache=cache)
    if fixes and plan.fits is False:
        plan = plan.with_fixes(ranked_fixes(plan, facts, cache=cache))
    return plan


def ranked_fixes(plan: MemoryPlan, facts: ModelFacts, *, cache: PlanCache | None = None) -> tuple[Fix, ...]:
    """Each change re-planned; those that fit first, lowest peak first."""
    fixes = []
    for candidate in candidate_changes(plan.request, facts):
        try:
            changed = plan_memory(candidate.request, fixes=False, cache=cache)
        except TwinkleError:
            continue  # a change the sizes refuse is no fix
        fixes.append(Fix(option=candidate.option, value=candidate.value, peak=changed.peak, fits=changed.fits,
                         note=candidate.note))
    return tuple(sorted(fixes, key=lambda f: (not f.fits, f.peak)))
