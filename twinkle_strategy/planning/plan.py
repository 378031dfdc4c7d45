"""A memory plan: every part of one rank's peak, the verdict against the budgets, and the fixes that fit.

:func:`plan_once` builds the model on meta (``skeleton``), counts the model states exactly
(``states``), traces the activations (``activations``), and adds them up as the run holds them at
the step's peak, which is one of two moments:

* without activation checkpointing, the end of the forward and the start of the backward (every layer's
  activations are kept and the head's loss gradient is being made; FSDP2 holds the root and the last layer
  gathered, which it gathers again at once for the backward's first layer, and no gradient exists yet): the
  trace's peak plus the root and the largest layer. Measured on a 217 MiB Qwen3-MoE, the run's peak is the
  last layer's forward and no layer's backward exceeds it (the root alone put the plan 16% under it);
* with it, inside a layer's backward: the layer is recomputed while the root and two layers are gathered
  (the one computing and the next, which FSDP2 prefetches) and, at the prefetched layer's copy-out, that
  layer's flat all-gather output beside its parameters; the gradients of the layers done so far exist (all
  of them are counted).

The optimizer step (AdamW's foreach updates hold one temporary the size of the trainable shards) is
the other candidate; the larger wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from twinkle_strategy.config import LoraExperts
from twinkle_strategy.dtypes import FLOAT_DTYPES
from twinkle_strategy.init.send_pool import FLAG_BYTES, SEND_BUFFERS
from twinkle_strategy.moe.discovery import unwrap_experts
from twinkle_strategy.planning.activations import ActivationPeak, measure_activations
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.skeleton import PlannedModel, build_planned_model
from twinkle_strategy.planning.states import ModelStates, model_states

GATHERED_LAYERS = 2  # the layer computing and the next, which FSDP2 prefetches in the backward
# FSDP2 all-gathers a unit into one flat output buffer, then copies it out into the unit's unsharded parameters
# (torch's foreach_all_gather / foreach_all_gather_copy_out): at the copy-out both are alive, one unit's bytes
# twice; in the forward the flat buffer is even kept until the next unit's copy-out (to overlap the two).
FLAT_ALL_GATHER_OUTPUTS = 1
ASSUMPTIONS = (
    "every row is max_length tokens (no padding); one micro-batch's activations at a time",
    "balanced routing: each EP rank receives its share of the rows (routing_skew times it on the busiest)",
    "without activation checkpointing the peak is the end of the forward and the start of the backward (the root "
    "and one layer gathered, no gradient yet); with it, a layer's backward (the root and two layers gathered, one layer's flat "
    "all-gather output at its copy-out, every gradient counted)",
    "tensor bytes only: the allocator's caching and fragmentation (often 5-15% on GPUs) and the CUDA context "
    "(about 0.5 GiB) come on top",
)
# The one phrase a plan with LoRA on the fused experts adds to its assumptions: the path it counted.
EXPERT_LORA_COUNTED = {
    LoraExperts.ACTIVATIONS: "LoRA on the experts counted as lora_experts=activations computes it: x @ W + (x @ A) @ B "
                             "per expert, the rows read and x @ A kept, W + BA never formed",
    LoraExperts.PEFT: "LoRA on the experts counted as lora_experts=peft computes it: W + BA formed for every local "
                      "expert and kept to the backward",
}


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """The parts of one rank's device memory at the step's peak, in bytes."""

    params: int  # sharded parameters (kept quantized bytes included)
    grads: int
    optimizer: int
    gathered: int  # FSDP2 units gathered at once, in the compute dtype: the root and the largest layer; with
    # activation checkpointing GATHERED_LAYERS layers and FLAT_ALL_GATHER_OUTPUTS layer's flat all-gather buffer
    decoded: int  # quantized_base=keep: the largest unit's weights decoded for its compute
    activations: int  # traced: embedding, every layer, head and loss, backward transients, EP dispatch buffers
    # (without activation checkpointing, with the two layers a layer's backward holds gathered, where that wins)
    optimizer_step: int  # the peak while AdamW steps (for comparison)

    @property
    def total(self) -> int:
        backward = self.params + self.grads + self.optimizer + self.gathered + self.decoded + self.activations
        return max(backward, self.optimizer_step)

    def parts(self) -> dict[str, int]:
        return {"sharded parameters": self.params, "gradients": self.grads, "optimizer state": self.optimizer,
                "gathered units (mixed precision)": self.gathered, "decoded quantized unit": self.decoded,
                "activations and EP buffers": self.activations}


@dataclasses.dataclass(frozen=True)
class InitMemory:
    """memory_efficient_init: host RAM of a node's source and of a receiver, device memory after wrapping."""

    source_host: int  # its shards and buffers, its send pool's buckets and the bytes it reads ahead
    receiver_host: int  # its shards and buffers, and its receive buffers beside them (buckets land in them)
    device_after_wrap: int  # shards and buffers on the device, every rank


@dataclasses.dataclass(frozen=True)
class CommBytes:
    """Bytes each rank sends per micro-batch (it receives as many at balanced routing)."""

    all_gather: int
    reduce_scatter: int
    all_to_all: int


# How a front-end spells setting an option to a value ("train.per_device_train_batch_size=2", "--... 2").
Spelling = Callable[[str, object], str]


@dataclasses.dataclass(frozen=True)
class Fix:
    """One change re-planned. ``option`` is named as the Python API names it (a StrategyConfig field or a
    PlanRequest argument); each front-end spells it as its users set it (:meth:`spelled`)."""

    option: str  # "ep_size", "micro_batch", "gradient_checkpointing", "nnodes" ...
    value: object  # what it is set to
    peak: int  # the step's peak with the change
    fits: bool | None
    note: str = ""  # what goes with it ("double the gradient accumulation")

    @property
    def change(self) -> str:
        """The change in the Python API's words: ``micro_batch=2 (double the gradient accumulation)``."""
        return self.spelled()

    def spelled(self, spelling: Spelling | None = None) -> str:
        """The change as ``spelling(option, value)`` writes it (the Python API's ``option=value`` without one)."""
        setting = spelling(self.option, self.value) if spelling else f"{self.option}={self.value!r}"
        return f"{setting} ({self.note})" if self.note else setting


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    notes: tuple[str, ...]
    states: ModelStates
    activations: ActivationPeak
    step: StepPeak
    init: InitMemory
    comm: CommBytes
    expert_lora: LoraExperts | None = None  # how LoRA on the fused experts was counted; None: no LoRA on them
    fixes: tuple[Fix, ...] = ()

    @property
    def assumptions(self) -> tuple[str, ...]:
        """What the figures assume, printed with every plan (with the LoRA-on-experts path it counted)."""
        return ASSUMPTIONS + ((EXPERT_LORA_COUNTED[self.expert_lora],) if self.expert_lora is not None else ())

    @property
    def peak(self) -> int:
        return self.step.total

    @property
    def fits(self) -> bool | None:
        """Whether the step's peak fits ``device_memory`` (None without a budget)."""
        budget = self.request.device_memory
        return None if budget is None else self.peak <= budget

    @property
    def host_fits(self) -> bool | None:
        budget = self.request.host_memory
        if budget is None:
            return None
        return self.init.source_host + (self.request.nproc_per_node - 1) * self.init.receiver_host <= budget

    def with_fixes(self, fixes: tuple[Fix, ...]) -> MemoryPlan:
        return dataclasses.replace(self, fixes=fixes)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the fixes read of the measured model, kept beside a plan so that a cached plan proposes them too."""

    num_experts: int | None  # experts of the first MoE block; None: a dense model
    attention_heads: int  # of the text model (0 when it has none)
    quantized: bool  # a quantized release (quantized_base=keep is a fix)
    ep_size: int
    sequence_parallel_size: int
    world_size: int

    @classmethod
    def of(cls, planned: PlannedModel) -> ModelFacts:
        dims = planned.dims
        heads = getattr(planned.config.get_text_config(), "num_attention_heads", 0) or 0
        return cls(num_experts=planned.blocks[0].num_experts if planned.blocks else None, attention_heads=heads,
                   quantized=planned.quantized is not None, ep_size=dims.ep_size,
                   sequence_parallel_size=dims.sp_size, world_size=dims.world_size)


def plan_once(request: PlanRequest) -> tuple[MemoryPlan, PlannedModel]:
    """The plan of ``request`` without fixes, and the model it measured (``fixes.plan_memory`` adds them)."""
    planned = build_planned_model(request)
    states = model_states(planned, request)
    expert_lora = LoraExperts(request.strategy.lora_experts) if _lora_on_experts(planned) else None
    # Without activation checkpointing the run's peak is the last layer's forward or the start of the backward,
    # with every activation alive: measured by the test's byte counter (which sees FSDP2's resized unsharded
    # storages), a layer's backward does not exceed it, and the trace with the root and the last layer gathered is
    # within 7% of the run (217 MiB Qwen3-MoE, tests/multiproc/test_plan_vs_run.py). Holding GATHERED_LAYERS layers in the trace's backward
    # (measure_activations' gathered_in_backward) put the plan 11% over the run there.
    activations = measure_activations(planned, request)  # (after the states)
    plan = MemoryPlan(request=request, notes=tuple(planned.notes), states=states, activations=activations,
                      step=_step_peak(states, activations, request), init=_init_memory(states, request),
                      comm=_comm_bytes(planned, states, request), expert_lora=expert_lora)
    return plan, planned


def _lora_on_experts(planned: PlannedModel) -> bool:
    """Whether PEFT put an adapter on a fused expert parameter (a ``ParamWrapper`` around an experts module)."""
    return any(unwrap_experts(block.experts)[1] for block in planned.blocks)


def _step_peak(states: ModelStates, activations: ActivationPeak, request: PlanRequest) -> StepPeak:
    optimizer_step = states.params + states.grads + states.optimizer + states.trainable_params
    if request.gradient_checkpointing:
        layers = GATHERED_LAYERS + FLAT_ALL_GATHER_OUTPUTS  # the next layer's copy-out in this one's backward
        grads, gathered = states.grads, states.root.unsharded + layers * states.largest_layer
    else:
        # The last layer's forward (and the backward's first layer) runs gathered while every activation is alive.
        grads, gathered = 0, states.root.unsharded + states.largest_layer
    return StepPeak(params=states.params, grads=grads, optimizer=states.optimizer, gathered=gathered,
                    decoded=states.kept_decoded_unit, activations=activations.total, optimizer_step=optimizer_step)


def _init_memory(states: ModelStates, request: PlanRequest) -> InitMemory:
    held = states.params + states.buffers
    if not request.strategy.memory_efficient_init:
        # Every rank loads the whole model on the CPU in the model's dtype, then keeps its shards.
        whole = states.total_params * FLOAT_DTYPES[request.dtype].itemsize
        return InitMemory(source_host=whole + held, receiver_host=whole + held, device_after_wrap=held)
    # The source sends through SEND_BUFFERS buckets of init_bucket_mb (each with its flag byte) and
    # reads about half a bucket ahead (init.send_pool).
    # With quantized_base=keep every shard is first allocated in the model's dtype (to_empty), then the kept
    # weights' stored bytes replace theirs before any bucket arrives: the larger of the two is a peak.
    allocated = max(held, states.params_as_values + states.buffers)
    bucket = request.strategy.init_bucket_bytes
    node_stream = held * (request.nproc_per_node - 1)
    source = allocated + SEND_BUFFERS * (bucket + FLAG_BYTES) + min(bucket // 2, node_stream)
    receiving = receive_buffers(held, bucket_bytes=bucket, transport=request.strategy.init_transport,
                                receivers=request.nproc_per_node - 1)
    return InitMemory(source_host=source, receiver_host=max(allocated, held + receiving), device_after_wrap=held)


def receive_buffers(stream: int, *, bucket_bytes: int, transport: str, receivers: int) -> int:
    """The most bytes a receiver's message buffers hold at once while its ``stream`` of bytes arrives (init.transport).

    ``p2p`` posts the next bucket's receive (a new buffer of the bucket plus its flag byte) before it unpacks
    the last one, so two buckets are alive at once; ``scatter`` receives one round's share of a bucket
    (``bucket_bytes / receivers``) at a time, the next buffer made before the last is dropped. A stream of one
    message holds one.
    """
    if receivers < 1 or stream <= 0:
        return 0
    message = bucket_bytes if transport == "p2p" else max(bucket_bytes // receivers, 1)
    if stream <= message:
        return stream + FLAG_BYTES
    return message + min(message, stream - message) + 2 * FLAG_BYTES


def _comm_bytes(planned: PlannedModel, states: ModelStates, request: PlanRequest) -> CommBytes:
    dims = planned.dims
    world = dims.world_size
    share = (world - 1) / world
    units = states.root.unsharded + sum(u.unsharded for u in states.layers)
    regathers = 1 if request.strategy.reshard_after_forward else 0
    layers_gathered = sum(u.unsharded for u in states.layers)
    all_gather = int(share * (units + regathers * layers_gathered))
    reduce_bytes = 4 if request.strategy.reduce_dtype == "float32" else 2  # (bf16 / fp16: reduce_dtype)
    reduce_scatter = int(share * states.trainable_elements / max(dims.ep_size, 1) * reduce_bytes)
    hidden = getattr(planned.config.get_text_config(), "hidden_size", 0)
    top_k = getattr(planned.config.get_text_config(), "num_experts_per_tok", 0) or 0
    tokens = request.micro_batch * math.ceil(request.max_length / dims.sp_size)
    compute_bytes = 4 if request.strategy.mixed_precision == "no" else 2
    rows = tokens * top_k * hidden * compute_bytes * (dims.ep_size - 1) / dims.ep_size
    all_to_all = int(4 * rows * len(planned.blocks)) if dims.ep_enabled else 0  # dispatch and combine, fwd and bwd
    return CommBytes(all_gather=all_gather, reduce_scatter=reduce_scatter, all_to_all=all_to_all)
