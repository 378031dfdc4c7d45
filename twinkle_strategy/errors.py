"""Every exception twinkle_strategy raises on purpose, in one place.

Each names what was expected, what was found, and how to fix it. They subclass ValueError
(through TwinkleError) because every one of them is caused by input (sizes, launch settings,
checkpoints, data, a dead peer), not by a bug in this package. The training application's own
errors (recipes, datasets, preflight, a stopped run) live in :mod:`twinkle_strategy.train.errors`, and the swift
plugin's in :mod:`twinkle_strategy.integrations.swift.errors`, subclasses of the same TwinkleError, so one
``except TwinkleError`` still catches them all.
:func:`shorten` words the lists they name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TwinkleError(ValueError):
    """Base class of every error this package raises on purpose."""


# ------------------------------------------------------------------ the strategy library
class StrategyConfigError(TwinkleError):
    """A strategy option with a value that cannot work; ``key`` is the option's name."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key = key
        self.reason = reason


class ArgumentError(TwinkleError):
    """An argument of one of the package's functions with a value that cannot work (not a strategy option: those
    are :class:`StrategyConfigError`); the message names the argument and the fix."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a type the function cannot use; a TypeError too, as Python's own error for it is."""


class UnknownKeywordError(ArgumentTypeError):
    """A keyword argument the function or class does not take (a misspelt option), named with the closest one it
    does; a TypeError, as Python's own "unexpected keyword argument" is."""


class CallOrderError(TwinkleError, RuntimeError):
    """A method called before what it needs has run (routing replay before ``wrap_model``); a RuntimeError too,
    as it was before it became one of the package's errors."""


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


class WeightsNotLoadedError(TwinkleError):
    """A placeholder tensor was used before ``wrap_model`` read its weights."""


class FrozenWeightError(TwinkleError):
    """Something tried to change a frozen weight kept as its quantized release stores it (quantized_base=keep)."""


class InternalChangedError(TwinkleError):
    """A private part of transformers, accelerate or torch that twinkle_strategy relies on is gone from the
    installed version; names it, the version, what it is used for and the versions it was checked on
    (:mod:`twinkle_strategy.compat`)."""


class RanksFailedError(TwinkleError):
    """One or more ranks failed; raised on every rank with every failing rank's reason."""

    def __init__(self, message: str, failures: list[tuple[int, str]]):
        super().__init__(message)
        self.failures = failures


class DistributedInitError(RanksFailedError):
    """memory_efficient_init (or loading) failed on some rank; raised on every rank."""


class CheckpointSaveError(RanksFailedError):
    """Saving a checkpoint failed on some rank; previous checkpoints are untouched."""


class RoutingRecordError(RanksFailedError):
    """A routing record (``routed_experts``) that does not fit its batch or the model; raised on every rank."""


class WeightSyncError(RanksFailedError):
    """Sending the trained weights to a rollout engine failed on some rank (the receiver refused them, died or
    failed); raised on every rank, the model untouched."""


# ------------------------------------------------------------------ the library's front-ends and runs
class PackingError(TwinkleError):
    """A model that packed (padding-free) batches cannot serve: its layers would mix the packed examples."""


class TrainingAbortedError(TwinkleError):
    """A training step failed because a peer rank died, hung or failed."""


class ConflictingShardingError(TwinkleError):
    """A trainer setting (DeepSpeed, accelerate's FSDP, transformers' own EP) would shard the model a second time."""


class OutputDirNotSharedError(TwinkleError):
    """Ranks see different contents in the output directory (each node its own disk): saves need a shared one."""


class PlanInputError(TwinkleError):
    """A memory plan cannot be made from what it was given (a missing config.json, a size it cannot read)."""


def did_you_mean(name: str, known: Iterable[str], *, prefix: str = "") -> str:
    """``did you mean <prefix><closest>?`` for the name in ``known`` closest to a misspelt ``name``, or "" when none
    is close (difflib's ratio at least 0.6): the hint of every "unknown option / flag / keyword" message."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"did you mean {prefix}{close[0]}?" if close else ""


def shorten(items: Iterable[object], n: int, sep: str = ", ") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, then how many are left out: ``a, b and 3 more``
    (``a; b; and 3 more`` with ``sep="; "``), so a message names what is wrong without listing all of it."""
    items = [str(item) for item in items]
    shown = sep.join(items[:n])
    if len(items) <= n:
        return shown
    return f"{shown}{sep.rstrip(', ')} and {len(items) - n} more"
