"""twinkle_strategy: FSDP2 + expert parallelism for Mixture-of-Experts training."""

from twinkle_strategy import log  # noqa: F401  (configures the package logger)
from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import ModelStructureError, ParallelConfigError, TopologyError, TwinkleError
from twinkle_strategy.moe.expert_parallel import apply_expert_parallel
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.strategy import NativeFSDPStrategy

__version__ = "0.1.0"

__all__ = [
    "NativeFSDPStrategy",
    "StrategyConfig",
    "ParallelDims",
    "apply_expert_parallel",
    "TwinkleError",
    "TopologyError",
    "ParallelConfigError",
    "ModelStructureError",
]
