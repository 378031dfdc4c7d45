"""Settings that would shard the model a second time, refused in one line; and a misspelt keyword of the trainer.

NativeFSDPStrategy owns EP and FSDP2. DeepSpeed, accelerate's FSDP plugin and transformers' own
``distributed_config`` EP each shard (or broadcast) the same parameters their own way: combined,
training would hang at load (DeepSpeed ZeRO-3 with EP, transformers#45548) or run on rank 0's
experts everywhere (accelerate's FSDP2 broadcast, transformers#45662). Nothing here needs a
collective: every rank reads the same settings and raises the same error on its own.

When each check runs:

* what ``accelerate launch`` put in the environment
  (:func:`twinkle_strategy.distributed.launch_conflicts.refuse_accelerate_sharding`):
  first thing in ``NativeFSDPStrategy.from_pretrained``, before the process group and any file,
  and again when the trainer is built (for a model loaded some other way);
* ``TrainingArguments`` (``deepspeed=``, ``fsdp=``, ``bf16``/``fp16``) and a model transformers sharded at
  load: when the trainer is built (``with_strategy(...)(...)``), before it touches the model; the model is
  then only loaded, not sharded, and no rank has received a weight from another.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterable

from twinkle_strategy.distributed.launch_conflicts import refuse_accelerate_sharding, zero_stage
from twinkle_strategy.errors import ConflictingShardingError, UnknownKeywordError, did_you_mean, shorten


def refuse_conflicting_sharding(training_args=None, *, environ=None) -> None:
    """Raise :class:`ConflictingShardingError` naming the first setting that shards the model besides the strategy.

    ``training_args``: a ``transformers.TrainingArguments`` (TRL's configs subclass it), or None to check only
    what ``accelerate launch`` put in the environment (``environ``, default ``os.environ``).
    """
    refuse_accelerate_sharding(environ)
    if training_args is not None:
        _refuse_in_training_arguments(training_args)


def _refuse_in_training_arguments(args) -> None:
    deepspeed = getattr(args, "deepspeed", None)
    if deepspeed:
        stage = zero_stage(deepspeed)
        raise ConflictingShardingError(
            f"TrainingArguments.deepspeed={_shown(deepspeed)} (DeepSpeed{f' ZeRO-{stage}' if stage else ''}) cannot "
            "run with NativeFSDPStrategy, which shards the model itself: drop deepspeed= (--deepspeed)")
    if getattr(args, "fsdp", None):
        raise ConflictingShardingError(
            f"TrainingArguments({fsdp_as_passed(args)}) cannot run with NativeFSDPStrategy, which applies FSDP2 and "
            "EP itself: drop fsdp= and fsdp_config= (--fsdp); strategy options go to NativeFSDPStrategy(...)")
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        which = "bf16" if args.bf16 else "fp16"
        raise ConflictingShardingError(
            f"TrainingArguments.{which}=True adds accelerate's autocast on top of FSDP2: set {which}=False and "
            f"NativeFSDPStrategy(mixed_precision='{which}') instead (compute in {which}, gradients reduced in fp32)")


# transformers >= 5.19 turns the legacy fsdp="full_shard offload ..." into fsdp=True plus these fsdp_config entries
# (TrainingArguments._apply_legacy_fsdp_to_config); read back, they name what the user wrote.
_LEGACY_FSDP_OPTIONS = (("reshard_after_forward", True, "full_shard"), ("reshard_after_forward", False, "shard_grad_op"),
                        ("cpu_offload", True, "offload"))


def fsdp_as_passed(args) -> str:
    """``TrainingArguments.fsdp`` as the user wrote it: transformers keeps ``fsdp=True`` whatever was passed and
    moves a legacy string's options into ``fsdp_config``, where this reads them back."""
    if args.fsdp is not True:
        return f"fsdp={args.fsdp!r}"
    config = args.fsdp_config or {}
    options = [name for key, value, name in _LEGACY_FSDP_OPTIONS if key in config and config[key] is value]
    if not options:
        return "fsdp=True"
    entries = ", ".join(f"{key!r}: {config[key]!r}" for key, _, name in _LEGACY_FSDP_OPTIONS if name in options)
    return f"fsdp={' '.join(options)!r}, or fsdp=True with fsdp_config={{{entries}}}"


def refuse_transformers_expert_parallel(model) -> None:
    """Refuse a model that transformers sharded at load (``from_pretrained(distributed_config=...)``)."""
    if getattr(model, "is_distributed_loading_by_transformers", False):
        raise ConflictingShardingError(
            "the model was sharded by transformers at load (from_pretrained(distributed_config=...)): "
            "load it with NativeFSDPStrategy.from_pretrained instead, which applies EP and FSDP2 itself")


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else "{...}"


# Python's own words for a keyword a function does not take (the name in quotes).
_UNEXPECTED_KEYWORD = re.compile(r"got an unexpected keyword argument '(\w+)'")


@contextlib.contextmanager
def naming_unknown_keywords(trainer_class: type, keywords: Iterable[str]):
    """Inside, Python's "unexpected keyword argument" for one of ``keywords`` (what the user passed to
    ``trainer_class``) becomes an :class:`UnknownKeywordError` naming the closest keyword the class takes (a
    misspelt ``routing_reply=``): one line under torchrun, where the bare TypeError is a traceback on every rank.

    The TypeError itself says which keyword was not taken, so a keyword that a class of the trainer's takes through
    ``**kwargs`` is never refused here."""
    try:
        yield
    except TypeError as exc:
        unexpected = _UNEXPECTED_KEYWORD.search(str(exc))
        if unexpected is None or unexpected.group(1) not in keywords:
            raise
        name = unexpected.group(1)
        known = accepted_keywords(trainer_class)
        hint = did_you_mean(name, known) or f"it takes {shorten(sorted(known), 12)}"
        raise UnknownKeywordError(f"{trainer_class.__name__} takes no keyword argument {name}=; {hint}") from exc


def accepted_keywords(trainer_class: type) -> set[str]:
    """The named parameters of every ``__init__`` in ``trainer_class``'s MRO (the strategy's mixins' and the
    trainer's own)."""
    names = set()
    for cls in trainer_class.__mro__:
        init = vars(cls).get("__init__")
        if init is None or cls is object:
            continue
        names.update(name for name, parameter in inspect.signature(init).parameters.items()
                     if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD))
    return names
