"""Exceptions raised by twinkle_strategy.

Each names what was expected, what was found, and how to fix it. They subclass
ValueError because every one of them is caused by input (sizes, launch
settings, checkpoints), not by a bug in this package.
"""


class TwinkleError(ValueError):
    """Base class of every error this package raises on purpose."""


class TopologyError(TwinkleError):
    """The launch layout (ranks per node, torchrun variables) cannot be served."""


class ParallelConfigError(TwinkleError):
    """Parallel sizes (world, ep, ep_fsdp, number of experts) do not fit together."""


class ModelStructureError(TwinkleError):
    """The model does not have the structure a requested feature needs (e.g. no MoE block with ep>1)."""


class CheckpointError(TwinkleError):
    """The checkpoint does not match the model (missing or wrong-shaped tensors, unreadable files)."""


class ResumeError(TwinkleError):
    """A checkpoint that cannot be resumed from (incomplete, or incompatible with this run)."""


class OutputDirNotSharedError(TwinkleError):
    """Ranks see different contents in the output directory (each node its own disk): saves need a shared one."""
