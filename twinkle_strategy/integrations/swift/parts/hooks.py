"""Installing the plugin into ms-swift 4.x: hooks, each a wrapper around swift's own method.

1. ``SftArguments._init_deepspeed`` -> :func:`~.arguments.init_deepspeed` (``--deepspeed`` refused first)
   ``SftArguments._init_fsdp``    -> :func:`~.arguments.init_fsdp`
   (and ``SftArguments._check_padding_free`` -> :func:`~.sequence.check_padding_free`)
2. ``ModelLoader.load``           -> :func:`~.loading.load`
3. ``TunerMixin.prepare_model``   -> :func:`prepare_model` (swift's tuner, then EP + FSDP2)
4. ``TrainerFactory.get_trainer_cls`` -> :func:`~.trainer.get_trainer_cls`
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.integrations.swift.parts.arguments import init_deepspeed, init_fsdp
from twinkle_strategy.integrations.swift.parts.loading import install_experts_patch_hooks, load
from twinkle_strategy.integrations.swift.parts.sequence import check_padding_free
from twinkle_strategy.integrations.swift.parts.state import get_strategy
from twinkle_strategy.integrations.swift.parts.trainer import get_trainer_cls
from twinkle_strategy.integrations.transformers.trainer import prepare_for_trainer
from twinkle_strategy.sequence.packed import PackingOption, prepare_for_packed_batches

SWIFT_PACKING = PackingOption(name="--packing / --padding_free", turn_off="set --packing false --padding_free false")


def prepare_model(orig, cls, args, model, *pargs, **kwargs):
    """Hook of ``TunerMixin.prepare_model``: swift's tuner on the whole model, then EP + FSDP2."""
    if isinstance(model, FSDPModule):
        return orig.__func__(cls, args, model, *pargs, **kwargs)
    strategy = get_strategy()
    # The same fresh adapter whatever the number of nodes: with memory_efficient_init the source's
    # adapter is the one every rank receives, so only its RNG matters; without it all ranks agree.
    torch.manual_seed(args.seed)
    model = orig.__func__(cls, args, model, *pargs, **kwargs)
    if args.packing or args.padding_free:  # before any weight is read: refuse a family that mixes packed examples
        prepare_for_packed_batches(model, option=SWIFT_PACKING)
    # EP + FSDP2, checkpointing that replays the EP dispatch, accelerate kept off: as for any transformers.Trainer
    return prepare_for_trainer(strategy, model)  # (the strategy has logged its init report already)


def _patch(owner, name: str, hook, kind: str = "method") -> None:
    original = owner.__dict__[name]
    if getattr(getattr(original, "__func__", original), "_twinkle_hook", False):
        return  # already hooked (this file imported under two names, or replayed in a dataloader worker)
    if kind == "classmethod":
        @classmethod
        @functools.wraps(original.__func__)
        def wrapper(cls, *args, **kwargs):
            return hook(original.__get__(None, cls), cls, *args, **kwargs)

        wrapper.__func__._twinkle_hook = True
    else:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return hook(original, self, *args, **kwargs)

        wrapper._twinkle_hook = True
    setattr(owner, name, wrapper)


def install() -> None:
    """Hook NativeFSDPStrategy into ms-swift (idempotent). Called when swift imports this module."""
    from swift.arguments import SftArguments
    from swift.model.register import ModelLoader
    from swift.pipelines.train.tuner import TunerMixin
    from swift.trainers import TrainerFactory

    _patch(SftArguments, "_init_deepspeed", init_deepspeed)
    _patch(SftArguments, "_check_padding_free", check_padding_free)
    _patch(SftArguments, "_init_fsdp", init_fsdp)
    _patch(ModelLoader, "load", load)
    _patch(TunerMixin, "prepare_model", prepare_model, kind="classmethod")
    _patch(TrainerFactory, "get_trainer_cls", get_trainer_cls, kind="classmethod")
    install_experts_patch_hooks()
