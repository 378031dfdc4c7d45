"""swift's arguments: the strategy options read, the arguments checked, FSDP hidden from transformers and accelerate."""

from __future__ import annotations

import json
import logging
import os

from twinkle_strategy import config
from twinkle_strategy.distributed.runtime import apply_backend_env_defaults, backend_for, detect_device_type
from twinkle_strategy.integrations.swift.errors import SwiftPluginError
from twinkle_strategy.integrations.swift.parts.fit import check_fit
from twinkle_strategy.integrations.swift.parts.options import resolve_options
from twinkle_strategy.integrations.swift.parts.sequence import take_sequence_parallel
from twinkle_strategy.integrations.swift.parts.state import STATE, strategy_options
from twinkle_strategy.integrations.transformers.refusals import refuse_conflicting_sharding

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")


def check_arguments(args) -> None:
    """Refuse swift arguments the plugin cannot serve (one line naming the flag and the fix)."""
    if getattr(args, "rlhf_type", None) is not None:
        raise SwiftPluginError("the twinkle plugin supports `swift sft` and `swift pt`, not `swift rlhf`")
    refuse_deepspeed(args)
    if getattr(args, "tuner_type", "lora") not in ("lora", "full"):
        raise SwiftPluginError(f"--tuner_type {args.tuner_type} is not supported with the twinkle plugin; "
                               "use lora (with --target_parameters for expert LoRA) or full")
    if getattr(args, "use_swift_lora", False) or getattr(args, "tuner_backend", "peft") != "peft":
        raise SwiftPluginError("the twinkle plugin needs PEFT LoRA: drop --use_swift_lora/--tuner_backend")
    if args.tuner_type == "lora" and getattr(args, "target_parameters", None):
        # PEFT's ParamWrapper (LoRA on fused expert tensors) does not take these options, whichever way
        # lora_experts computes it: refused before the model loads.
        bad = [(f"--lora_dropout {args.lora_dropout}", "--lora_dropout 0", bool(args.lora_dropout)),
               ("--use_dora true", "--use_dora false", bool(getattr(args, "use_dora", False))),
               (f"--lora_bias {args.lora_bias}", "--lora_bias none", getattr(args, "lora_bias", "none") != "none")]
        for option, fix, is_bad in bad:
            if is_bad:
                raise SwiftPluginError(
                    f"{option} cannot be used with --target_parameters {' '.join(args.target_parameters)} "
                    f"(LoRA on fused expert weights): pass {fix}, or drop --target_parameters")


def refuse_deepspeed(args) -> None:
    """``--deepspeed`` refused in one line (NativeFSDPStrategy shards the model, DeepSpeed would again)."""
    value = getattr(args, "deepspeed", None)
    if value:
        shown = value if isinstance(value, str) else "{...}"
        raise SwiftPluginError(f"--deepspeed {shown} and the twinkle plugin both shard the model: drop --deepspeed "
                               "(the plugin applies FSDP2 and EP itself; its options are TWINKLE_* variables or "
                               'the --fsdp JSON\'s "twinkle" object)')


def init_deepspeed(orig, self) -> None:
    """Hook of ``SftArguments._init_deepspeed``, which swift runs just before ``_init_fsdp``: ``--deepspeed``
    is refused in the plugin's words before swift asks for the deepspeed package or reads its config."""
    refuse_deepspeed(self)
    return orig(self)


def _read_fsdp_json(value) -> dict:
    """swift's ``--fsdp``: a preset name ('fsdp2'), a JSON file or a JSON string."""
    from swift.utils import json_parse_to_dict

    if value == "fsdp2":
        import swift

        value = os.path.join(os.path.dirname(swift.__file__), "config", "fsdp2.json")
    config = json_parse_to_dict(value)
    if not isinstance(config, dict):
        raise SwiftPluginError(f"--fsdp {value!r}: expected a preset name, a JSON file or a JSON object")
    return config


def init_fsdp(_orig, self) -> None:
    """Hook of ``SftArguments._init_fsdp``: read the options, check everything, then hide FSDP from swift."""
    # The strategy shards the model. transformers and accelerate must not see FSDP: they would load
    # zero-filled copies on other ranks, shard again, or save with a state dict that ignores EP.
    # ``--fsdp`` is read here only for its options, and then cleared.
    if self.fsdp:
        fsdp_json = _read_fsdp_json(self.fsdp)  # (not `config`: that name is the options module)
        fsdp_config = fsdp_json.get("fsdp_config") or {}
        if int(fsdp_config.get("fsdp_version", 2)) != 2:
            raise SwiftPluginError("--fsdp: the twinkle plugin is FSDP2; drop fsdp_version or set it to 2")
        twinkle = fsdp_json.get("twinkle", fsdp_config.get("twinkle")) or {}
        if not isinstance(twinkle, dict):
            raise SwiftPluginError(f'--fsdp: "twinkle" must be a JSON object, got {twinkle!r}')
        twinkle = dict(twinkle)
        if "reshard_after_forward" in fsdp_config:
            twinkle.setdefault("reshard_after_forward", fsdp_config["reshard_after_forward"])
        if config.parse_bool(fsdp_config.get("activation_checkpointing", False)) and not self.gradient_checkpointing:
            logger.info("twinkle swift plugin: fsdp_config.activation_checkpointing -> --gradient_checkpointing")
            self.gradient_checkpointing = True
        STATE.fsdp_options = twinkle
    self.fsdp = []
    self.fsdp_config = None
    STATE.args = self
    options = resolve_options(STATE.fsdp_options)  # option errors now, before any model is loaded
    check_arguments(self)
    # --packing / --padding_free stay swift's data path; --sequence_parallel_size becomes the strategy's (.sequence).
    STATE.sequence_parallel_size = take_sequence_parallel(self, option=options.get("sequence_parallel_size"))
    refuse_conflicting_sharding()  # `accelerate launch --use_deepspeed/--use_fsdp`: before any weight is read
    # Precision is FSDP2's MixedPrecisionPolicy (compute in bf16, reduce gradients in fp32), not accelerate's
    # autocast + GradScaler: a scaler's unscale step would not see our EP-aware clipping.
    STATE.swift_precision = "bf16" if self.bf16 else "no"
    self.bf16 = self.fp16 = False
    device_type = detect_device_type()
    # Will it fit? Planned from config.json alone, on every rank alike, before any weight is read (.fit).
    strategy_config = config.StrategyConfig(backend=getattr(self, "ddp_backend", None), **strategy_options())
    check_fit(self, strategy_config, device_type=strategy_config.device_type or device_type,
              fsdp_options=STATE.fsdp_options)
    # Before accelerate creates the process group (the strategy then reuses it).
    apply_backend_env_defaults(backend_for(device_type, self.ddp_backend))
    if device_type == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        self.use_cpu = True  # otherwise transformers sees no distributed job on CPU (no gloo data parallelism)
    if self.gradient_checkpointing:
        # FSDP2 re-gathers parameters inside the recomputation; reentrant checkpointing does not work with that.
        kwargs = self.gradient_checkpointing_kwargs
        if isinstance(kwargs, str):
            kwargs = json.loads(kwargs)
        kwargs = dict(kwargs or {})
        kwargs.setdefault("use_reentrant", False)
        self.gradient_checkpointing_kwargs = kwargs
