"""twinkle_strategy: FSDP2 + expert parallelism for Mixture-of-Experts training.

What a user trains with, importable from here: the strategy and its options, twinkle's Trainer with its
arguments and SFT data, the ``transformers.Trainer`` mixin, the errors, the demo model. The names load on first use
(a module ``__getattr__``, PEP 562): importing the package, or one module of it such as ``twinkle_strategy.errors``,
loads that module and the package logger, not the library; ``from twinkle_strategy import NativeFSDPStrategy``
loads the strategy, not the training application (``train/``) nor the integrations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from twinkle_strategy import log  # noqa: F401  (configures the package logger)

if TYPE_CHECKING:
    from twinkle_strategy.config import StrategyConfig
    from twinkle_strategy.errors import ModelStructureError, ParallelConfigError, TopologyError, TwinkleError
    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel
    from twinkle_strategy.parallel import ParallelDims
    from twinkle_strategy.sources.demo import demo_dataset_path, demo_model_path
    from twinkle_strategy.strategy import NativeFSDPStrategy

__version__ = "0.1.0"

# each name of __all__ -> the module that defines it (the imports above say the same to type checkers)
_EXPORTS = {
    "NativeFSDPStrategy": "twinkle_strategy.strategy",
    "StrategyConfig": "twinkle_strategy.config",
    # The two front-ends users train with (no TYPE_CHECKING import above: the library imports no front-end).
    "Trainer": "twinkle_strategy.train.trainer",
    "TrainingArguments": "twinkle_strategy.train.arguments",
    "SFTDataset": "twinkle_strategy.train.data",
    "DataCollatorForSFT": "twinkle_strategy.train.data",
    "with_strategy": "twinkle_strategy.integrations.transformers.classes",
    "ParallelDims": "twinkle_strategy.parallel",
    "apply_expert_parallel": "twinkle_strategy.moe.expert_parallel",
    "TwinkleError": "twinkle_strategy.errors",
    "TopologyError": "twinkle_strategy.errors",
    "ParallelConfigError": "twinkle_strategy.errors",
    "ModelStructureError": "twinkle_strategy.errors",
    "demo_model_path": "twinkle_strategy.sources.demo",
    "demo_dataset_path": "twinkle_strategy.sources.demo",
}

__all__ = [
    "NativeFSDPStrategy",
    "StrategyConfig",
    "Trainer",
    "TrainingArguments",
    "SFTDataset",
    "DataCollatorForSFT",
    "with_strategy",
    "ParallelDims",
    "apply_expert_parallel",
    "TwinkleError",
    "TopologyError",
    "ParallelConfigError",
    "ModelStructureError",
    "demo_model_path",
    "demo_dataset_path",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
