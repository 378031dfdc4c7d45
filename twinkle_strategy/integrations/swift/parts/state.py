"""What one training process of the plugin knows: swift's arguments, the options, the strategy (built once)."""

from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Any

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.distributed.runtime import destroy_process_group
from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.integrations.swift.parts.options import resolve_options
from twinkle_strategy.strategy import NativeFSDPStrategy

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")


@dataclasses.dataclass
class PluginState:
    """The plugin's state in this process (one per process: swift imports the plugin once)."""

    args: Any = None  # swift's SftArguments, once parsed
    fsdp_options: dict = dataclasses.field(default_factory=dict)  # the --fsdp JSON's "twinkle" object
    swift_precision: str = "no"  # "bf16" when swift was given --bf16 (the strategy's mixed_precision then)
    strategy: NativeFSDPStrategy | None = None
    loaded_checkpoint: bool | None = None  # whether this rank opened the checkpoint (None: not loaded yet)
    sequence_parallel_size: int = 1  # swift's --sequence_parallel_size, served by the strategy (swift's own is 1)


STATE = PluginState()


def _destroy_process_group() -> None:
    # swift leaves the process group to interpreter teardown, where a gloo worker still releasing its last
    # collective aborts the process ("terminate called without an active exception", SIGABRT; see
    # twinkle_strategy.distributed.teardown). Tear it down while Python runs, and let the workers settle.
    destroy_process_group()


def strategy_options() -> dict[str, Any]:
    """The StrategyConfig fields of this run: the options, swift's --sequence_parallel_size and its precision."""
    options = resolve_options(STATE.fsdp_options)
    options["sequence_parallel_size"] = STATE.sequence_parallel_size  # swift's flag, taken in .arguments
    options.setdefault("mixed_precision", STATE.swift_precision)
    return options


def get_strategy() -> NativeFSDPStrategy:
    """The process's NativeFSDPStrategy, built on first use from the options and swift's arguments."""
    if STATE.strategy is None:
        options = strategy_options()
        strategy = NativeFSDPStrategy(StrategyConfig(backend=getattr(STATE.args, "ddp_backend", None), **options))
        try:
            strategy.setup()
        except ParallelConfigError as exc:  # the library names torchrun; swift starts its processes from these
            raise ParallelConfigError(f"{exc}; with swift sft: NPROC_PER_NODE (and NNODES)") from exc
        STATE.strategy = strategy
        atexit.register(_destroy_process_group)
        if strategy.is_main_process:
            logger.info("twinkle swift plugin: NativeFSDPStrategy(%s), world_size=%d, nodes=%d",
                        ", ".join(f"{k}={v}" for k, v in options.items()), strategy.world_size,
                        strategy.topology.num_nodes)
    return STATE.strategy
