"""What a memory plan is asked: the model, the world, the recipe's shape of a step, and the budgets.

A :class:`PlanRequest` names the options as the Python API does (:class:`StrategyConfig` fields and
plain keyword arguments); the twinkle-sft command builds one from a recipe.
"""

from __future__ import annotations

import dataclasses
import os
import re

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import PlanInputError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int | float | None, *, what: str) -> int | None:
    """Bytes of ``80GiB``, ``80GB``, ``141G`` (decimal G as GPU makers write it), or a plain number of bytes."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise PlanInputError(f"{what}={text!r} is not a size; write it as 80GiB, 80GB or 141G")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class LoraShape:
    """The LoRA adapter trained on a frozen base (PEFT's LoraConfig fields that change memory)."""

    rank: int = 8
    alpha: int = 32
    target_modules: tuple[str, ...] = ("all-linear",)
    target_parameters: tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One configuration to plan; every size the launch would check is checked the same way."""

    model_path: str  # a directory holding config.json (and, for a quantized release, its index)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    nnodes: int = 1
    nproc_per_node: int = 1
    dtype: str = "bfloat16"  # the dtype the model is loaded in
    lora: LoraShape | None = dataclasses.field(default_factory=LoraShape)  # None: every parameter trains
    micro_batch: int = 1  # examples per rank and micro-batch
    max_length: int = 2048  # tokens per example (the plan assumes every row is this long)
    gradient_checkpointing: bool = False
    routing_skew: float = 1.0  # the busiest EP rank receives this many times its balanced share of tokens
    device_memory: int | None = None  # bytes per device; None: no verdict for the device
    host_memory: int | None = None  # bytes per node; None: no verdict for host RAM
    device_type: str = "cuda"  # cuda (FSDP2 prefetches the next unit) | cpu (gloo: synchronous)

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "micro_batch", "max_length"):
            if getattr(self, name) < 1:
                raise PlanInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.routing_skew < 1:
            raise PlanInputError(f"routing_skew must be >= 1 (1 = balanced routing), got {self.routing_skew}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def config_file(self) -> str:
        return os.path.join(self.model_path, "config.json")

    def replace(self, **changes) -> PlanRequest:
        return dataclasses.replace(self, **changes)


def strategy_request(strategy: StrategyConfig, model_path: str, *, nnodes: int = 1, nproc_per_node: int = 1,
                     **request) -> PlanRequest:
    """``NativeFSDPStrategy.plan``'s request: ``strategy``'s run of ``model_path``, the memory budgets given as
    bytes or as sizes (``80GiB``, ``141G``)."""
    for budget in ("device_memory", "host_memory"):
        if isinstance(request.get(budget), str):
            request[budget] = parse_size(request[budget], what=budget)
    return PlanRequest(model_path=model_path, strategy=strategy, nnodes=nnodes, nproc_per_node=nproc_per_node,
                       **request)
