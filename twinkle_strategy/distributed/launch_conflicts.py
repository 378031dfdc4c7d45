"""What a launcher put in the environment that would shard or broadcast the model besides the strategy.

``accelerate launch --use_deepspeed`` / ``--use_fsdp`` (or an accelerate config naming DeepSpeed or FSDP)
export ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP``; FSDP's ``cpu_ram_efficient_loading``
exports ``FSDP_CPU_RAM_EFFICIENT_LOADING``, under which transformers loads the real weights on local
rank 0 only and zeros everywhere else, for accelerate to broadcast rank 0's tensors over them (EP-cut
experts included: transformers#45662). Combined with NativeFSDPStrategy, training would hang at load
(DeepSpeed ZeRO-3 with EP, transformers#45548) or run on rank 0's experts everywhere.

Read from the environment alone: every rank of a launch sees the same variables and raises the same
error on its own, before the process group exists and before any file is read, so none waits for another.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from twinkle_strategy.errors import ConflictingShardingError

DROP_ACCELERATE = ("drop it from the accelerate config (distributed_type: MULTI_GPU, or `accelerate launch` without "
                   "--use_deepspeed/--use_fsdp): NativeFSDPStrategy shards the model itself")
_TRUE = {"1", "true", "yes", "y", "t", "on"}  # accelerate's str_to_bool


def refuse_accelerate_sharding(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConflictingShardingError` naming the first variable that asks accelerate (or transformers'
    loading under accelerate's FSDP) to shard or broadcast the model."""
    environ = os.environ if environ is None else environ
    if _on(environ, "ACCELERATE_USE_DEEPSPEED"):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") or zero_stage(
            environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
        raise ConflictingShardingError(
            f"accelerate's DeepSpeed{f' ZeRO-{stage}' if stage else ''} (ACCELERATE_USE_DEEPSPEED=true) cannot run "
            f"with NativeFSDPStrategy: {DROP_ACCELERATE}")
    if _on(environ, "ACCELERATE_USE_FSDP"):
        raise ConflictingShardingError(
            f"accelerate's FSDP plugin (ACCELERATE_USE_FSDP=true) cannot run with NativeFSDPStrategy: {DROP_ACCELERATE}")
    if _on(environ, "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        raise ConflictingShardingError(
            "FSDP_CPU_RAM_EFFICIENT_LOADING=true (accelerate's FSDP cpu_ram_efficient_loading: real weights on local "
            "rank 0 only, zeros elsewhere until rank 0 broadcasts its own) cannot run with NativeFSDPStrategy: unset "
            "it (and fsdp_cpu_ram_efficient_loading in the accelerate config, fsdp_config's cpu_ram_efficient_loading "
            "in TrainingArguments); memory_efficient_init=True is the strategy's node-local equivalent")


def _on(environ: Mapping[str, str], name: str) -> bool:
    return str(environ.get(name, "")).strip().lower() in _TRUE


def zero_stage(config) -> int | None:
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
