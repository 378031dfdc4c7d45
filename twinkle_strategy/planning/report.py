"""A plan as people read it (a table) and as scripts read it (``to_json``).

Each takes a front-end's ``spelling`` of the fixes (``train.per_device_train_batch_size=2`` for twinkle-sft,
``--per_device_train_batch_size 2`` for swift); without one they read as the Python API names them.
"""

from __future__ import annotations

import dataclasses
import textwrap

from twinkle_strategy.planning.plan import MemoryPlan, Spelling

GIB = 2**30


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 100 else f"{nbytes / 2**20:.2f} MiB"


def verdict_line(plan: MemoryPlan, *, spelling: Spelling | None = None) -> str:
    """One line: the peak, the budget, and (when it does not fit) the first fix."""
    budget = plan.request.device_memory
    if budget is None:
        return f"step peak {gib(plan.peak)} per rank (no device_memory given: no verdict)"
    if plan.fits:
        return f"fits: step peak {gib(plan.peak)} of {gib(budget)} per device, margin {gib(budget - plan.peak)}"
    first = next((f for f in plan.fixes if f.fits), None)
    fix = f"; first fix: {first.spelled(spelling)} (peak {gib(first.peak)})" if first else \
        "; no single change makes it fit"
    return f"does not fit: step peak {gib(plan.peak)} > device_memory {gib(budget)} per device{fix}"


def table(plan: MemoryPlan, *, spelling: Spelling | None = None) -> str:
    r, s = plan.request, plan.request.strategy
    lora = f"LoRA r={r.lora.rank}" if r.lora is not None else "full"
    lines = [f"memory plan: {r.model_path}",
             f"  {r.nnodes}x{r.nproc_per_node} ranks, ep_size={s.ep_size}, sequence_parallel_size="
             f"{s.sequence_parallel_size}, {lora}, dtype {r.dtype}, mixed_precision {s.mixed_precision}, micro-batch "
             f"{r.micro_batch} x {r.max_length} tokens, activation checkpointing "
             f"{'on' if r.gradient_checkpointing else 'off'}, quantized_base {s.quantized_base}",
             f"  parameters {_count(plan.states.total_params)}, trainable {_count(plan.states.trainable_elements)}"]
    lines += [f"  note: {note}" for note in plan.notes]
    lines.append("step peak, per rank (every rank holds the same padded shards):")
    for name, nbytes in plan.step.parts().items():
        lines.append(f"  {name:<34}{gib(nbytes):>14}")
    lines.append(f"  {'total':<34}{gib(plan.peak):>14}")
    lines.append("init (memory_efficient_init):" if s.memory_efficient_init else "init (every rank loads the model):")
    lines.append(f"  {'source host RAM':<34}{gib(plan.init.source_host):>14}")
    lines.append(f"  {'receiver host RAM':<34}{gib(plan.init.receiver_host):>14}")
    lines.append(f"  {'device memory after wrap':<34}{gib(plan.init.device_after_wrap):>14}")
    lines.append("communication per micro-batch, bytes each rank sends:")
    lines.append(f"  {'all-gathers':<34}{gib(plan.comm.all_gather):>14}")
    lines.append(f"  {'reduce-scatters':<34}{gib(plan.comm.reduce_scatter):>14}")
    lines.append(f"  {'EP all-to-alls (balanced)':<34}{gib(plan.comm.all_to_all):>14}")
    if plan.fixes:
        lines.append("fixes, ranked (each re-planned):")
        lines += [f"  {f.spelled(spelling):<50} peak {gib(f.peak)}{'' if f.fits else ' (still too big)'}"
                  for f in plan.fixes]
    lines += assumption_lines(plan.assumptions)
    lines.append(verdict_line(plan, spelling=spelling))
    return "\n".join(lines)


def to_json(plan: MemoryPlan, *, spelling: Spelling | None = None) -> dict:
    r = plan.request
    return {
        "model": r.model_path, "nnodes": r.nnodes, "nproc_per_node": r.nproc_per_node,
        "strategy": dataclasses.asdict(r.strategy), "lora": None if r.lora is None else dataclasses.asdict(r.lora),
        "micro_batch": r.micro_batch, "max_length": r.max_length, "gradient_checkpointing": r.gradient_checkpointing,
        "routing_skew": r.routing_skew, "notes": list(plan.notes), "assumptions": list(plan.assumptions),
        "step_peak_bytes": plan.peak, "step_parts_bytes": plan.step.parts(),
        "optimizer_step_bytes": plan.step.optimizer_step,
        "init_bytes": dataclasses.asdict(plan.init), "comm_bytes_per_micro_batch": dataclasses.asdict(plan.comm),
        "activations": {"base": plan.activations.base, "per_layer": plan.activations.per_layer,
                        "layer_counts": plan.activations.layer_counts, "tokens": plan.activations.tokens},
        "device_memory": r.device_memory, "host_memory": r.host_memory, "fits": plan.fits,
        "host_fits": plan.host_fits, "verdict": verdict_line(plan, spelling=spelling),
        "fixes": [{**dataclasses.asdict(f), "change": f.spelled(spelling)} for f in plan.fixes],
    }


ASSUMPTIONS_WIDTH = 100  # the assumptions' lines, wrapped to be read in a terminal (they were one line of ~550)


def assumption_lines(assumptions: tuple[str, ...]) -> list[str]:
    """A plan's assumptions, one item each, wrapped at ASSUMPTIONS_WIDTH columns."""
    lines = ["assumptions:"]
    for assumption in assumptions:
        lines += textwrap.wrap(assumption, width=ASSUMPTIONS_WIDTH, initial_indent="  - ", subsequent_indent="    ")
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"
