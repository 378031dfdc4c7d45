"""Settings that would shard the model a second time, refused in one line before any weight is read.

NativeFSDPStrategy owns EP and FSDP2. DeepSpeed, accelerate's FSDP plugin and transformers' own
``distributed_config`` EP each shard (or broadcast) the same parameters their own way: combined,
training would hang at load (DeepSpeed ZeRO-3 with EP, transformers#45548) or run on rank 0's
experts everywhere (accelerate's FSDP2 broadcast, transformers#45662). Nothing here needs a
collective: every rank reads the same settings and raises the same error on its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from twinkle_strategy.config import parse_bool
from twinkle_strategy.errors import ConflictingShardingError

_DROP_ACCELERATE = ("drop it from the accelerate config (distributed_type: MULTI_GPU, or `accelerate launch` "
                    "without --use_deepspeed/--use_fsdp): NativeFSDPStrategy shards the model itself")


def refuse_conflicting_sharding(training_args=None, *, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConflictingShardingError` naming the first setting that shards the model besides the strategy.

    ``training_args``: a ``transformers.TrainingArguments`` (TRL's configs subclass it), or None to check only
    what ``accelerate launch`` put in the environment.
    """
    environ = os.environ if environ is None else environ
    if parse_bool(environ.get("ACCELERATE_USE_DEEPSPEED", "false")):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") or _zero_stage(environ.get(
            "ACCELERATE_DEEPSPEED_CONFIG_FILE"))
        raise ConflictingShardingError(
            f"accelerate's DeepSpeed{f' ZeRO-{stage}' if stage else ''} (ACCELERATE_USE_DEEPSPEED=true) cannot run "
            f"with NativeFSDPStrategy: {_DROP_ACCELERATE}")
    if parse_bool(environ.get("ACCELERATE_USE_FSDP", "false")):
        raise ConflictingShardingError(
            f"accelerate's FSDP plugin (ACCELERATE_USE_FSDP=true) cannot run with NativeFSDPStrategy: {_DROP_ACCELERATE}")
    if training_args is not None:
        _refuse_in_training_arguments(training_args)


def _refuse_in_training_arguments(args) -> None:
    deepspeed = getattr(args, "deepspeed", None)
    if deepspeed:
        stage = _zero_stage(deepspeed)
        raise ConflictingShardingError(
            f"TrainingArguments.deepspeed={_shown(deepspeed)} (DeepSpeed{f' ZeRO-{stage}' if stage else ''}) cannot "
            "run with NativeFSDPStrategy, which shards the model itself: drop deepspeed= (--deepspeed)")
    if getattr(args, "fsdp", None):
        raise ConflictingShardingError(
            f"TrainingArguments.fsdp={args.fsdp!r} cannot run with NativeFSDPStrategy, which applies FSDP2 and EP "
            "itself: drop fsdp= and fsdp_config= (--fsdp); strategy options go to NativeFSDPStrategy(...)")
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        which = "bf16" if args.bf16 else "fp16"
        raise ConflictingShardingError(
            f"TrainingArguments.{which}=True adds accelerate's autocast on top of FSDP2: set {which}=False and "
            f"NativeFSDPStrategy(mixed_precision='{which}') instead (compute in {which}, gradients reduced in fp32)")


def refuse_transformers_expert_parallel(model) -> None:
    """Refuse a model that transformers sharded at load (``from_pretrained(distributed_config=...)``)."""
    if getattr(model, "is_distributed_loading_by_transformers", False):
        raise ConflictingShardingError(
            "the model was sharded by transformers at load (from_pretrained(distributed_config=...)): "
            "load it with NativeFSDPStrategy.from_pretrained instead, which applies EP and FSDP2 itself")


def _zero_stage(config) -> int | None:
    """The ZeRO stage of a DeepSpeed config (a dict, a JSON file or a JSON string), or None if unreadable."""
    try:
        if isinstance(config, str):
            if os.path.isfile(config):
                with open(config) as f:
                    config = json.load(f)
            else:
                config = json.loads(config)
        return int(config["zero_optimization"]["stage"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else "{...}"
