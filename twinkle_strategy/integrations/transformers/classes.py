""":func:`with_strategy`: the trainer class for a given ``transformers.Trainer`` class, with the strategy's mixin
placed first in its MRO (:class:`~.grpo.StrategyGRPOTrainerMixin` for TRL's ``GRPOTrainer``,
:class:`~.trainer.StrategyTrainerMixin` for the others, or a front-end's own)."""

from __future__ import annotations

from twinkle_strategy.compat.transformers_internals import check_trainer_overrides
from twinkle_strategy.compat.trl_internals import check_grpo_overrides
from twinkle_strategy.integrations.transformers.grpo import StrategyGRPOTrainerMixin
from twinkle_strategy.integrations.transformers.trainer import StrategyTrainerMixin

_CLASSES: dict[tuple[type, type], type] = {}


def with_strategy(trainer_class: type, *, mixin: type[StrategyTrainerMixin] | None = None) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass) training through a NativeFSDPStrategy:
    the returned class takes a ``strategy=`` keyword argument. The same class for the same input.
    TRL's ``GRPOTrainer`` (and subclasses) gets :class:`~.grpo.StrategyGRPOTrainerMixin` (generation on every
    rank, routing replay of its rollouts).

    ``mixin``: a subclass of :class:`StrategyTrainerMixin` adding a front-end's own hooks (the swift plugin's);
    the class is named after it (``StrategyTrainer``, ``TwinkleSeq2SeqTrainer``)."""
    grpo = _is_trl_grpo(trainer_class)
    if mixin is None:
        mixin = StrategyGRPOTrainerMixin if grpo else StrategyTrainerMixin
    if (mixin, trainer_class) not in _CLASSES:
        check_trainer_overrides(mixin)  # a private hook transformers renamed would never run
        if grpo:
            check_grpo_overrides(mixin)  # (and a GRPOTrainer step TRL renamed)
        prefix = vars(mixin).get("class_prefix", mixin.__name__.removesuffix("TrainerMixin"))
        _CLASSES[mixin, trainer_class] = type(f"{prefix}{trainer_class.__name__}", (mixin, trainer_class), {})
    return _CLASSES[mixin, trainer_class]


def _is_trl_grpo(trainer_class: type) -> bool:
    return any(cls.__name__ == "GRPOTrainer" and cls.__module__.startswith("trl.") for cls in trainer_class.__mro__)
