"""ms-swift integration: ``swift sft --external_plugins <this file>`` trains with NativeFSDPStrategy.

    twinkle-sft --swift-plugin-path          # prints this file's path
    TWINKLE_EP_SIZE=2 NPROC_PER_NODE=2 swift sft --external_plugins $(twinkle-sft --swift-plugin-path) \\
        --model Qwen/Qwen3-30B-A3B --dataset sft.jsonl --tuner_type lora --lora_dropout 0 \\
        --target_modules q_proj k_proj v_proj o_proj \\
        --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj

swift imports this module while it parses its arguments (``BaseArguments._import_external_plugins``),
in every training process and before anything else happens. Importing it hooks four places of
ms-swift 4.x; everything else (data, template, loss, logging, output layout) stays swift's own:

1. **Arguments** (``SftArguments._init_fsdp``): reads the strategy options (``TWINKLE_*``
   environment variables, or a ``"twinkle"`` object in the ``--fsdp`` JSON) and checks them and the
   LoRA options before any model is loaded. ``--fsdp`` is then cleared: transformers and
   accelerate must not shard, wrap or save the model themselves.
2. **Model loading** (``ModelLoader.load``): with ``memory_efficient_init`` every rank builds the
   model from its config without weights; each node's local rank 0 checks the checkpoint's headers
   and, in ``wrap_model``, reads only the rows its node keeps (``stream_checkpoint``, the default;
   checkpoints that cannot be streamed are loaded whole on that rank). Without it every rank loads
   on CPU. Missing, unexpected or wrong-shaped tensors fail on every rank, named by checkpoint key.
3. **Tuner** (``TunerMixin.prepare_model``): swift applies its tuner (``--tuner_type lora`` with
   ``--target_parameters`` for expert LoRA, or ``full``) to the whole, un-split model, so a LoRA
   adapter is the full ``[r*E]`` one; then ``strategy.wrap_model`` applies EP and FSDP2 and, with
   ``memory_efficient_init``, sends every rank exactly its shards from its node's source.
4. **Trainer** (``TrainerFactory.get_trainer_cls``): swift's trainer class, with EP-aware gradient
   clipping; full-parameter saves written by every rank in parallel into the checkpoint's
   safetensors files (``strategy.save_pretrained``: no gather, the source checkpoint's key layout),
   adapters gathered (small) and written by process zero; plus per-rank optimizer state so
   ``--resume_from_checkpoint`` continues exactly (same world size and ep_size).

Options (the ``--fsdp`` JSON's ``"twinkle"`` object wins over the environment)::

    TWINKLE_EP_SIZE=8                    "ep_size": 8                  ranks that split each MoE layer's experts
    TWINKLE_EP_FSDP_SIZE=2               "ep_fsdp_size": 2             default world_size / ep_size
    TWINKLE_MEMORY_EFFICIENT_INIT=1      "memory_efficient_init": true default true
    TWINKLE_STREAM_CHECKPOINT=1          "stream_checkpoint": true     read only each node's rows from the files
    TWINKLE_INIT_BUCKET_MB=256           "init_bucket_mb": 256
    TWINKLE_INIT_TRANSPORT=p2p           "init_transport": "p2p"       or "scatter"
    TWINKLE_VERIFY_INIT=0                "verify_init": false
    TWINKLE_MIXED_PRECISION=bf16         "mixed_precision": "bf16"     default: swift's --bf16/--fp16, else no
    TWINKLE_TIMEOUT_S=1800               "timeout_s": 1800
    TWINKLE_RESHARD_AFTER_FORWARD=1      "reshard_after_forward": true
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import sys
from typing import Any

import torch

from twinkle_strategy import config
from twinkle_strategy.compat.transformers_internals import (
    check_trainer_overrides,
    mark_accelerate_prepared,
    scheduler_file_name,
    trainer_save,
)
from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.errors import SwiftPluginError

_CANONICAL_NAME = "twinkle_strategy.integrations.swift.plugin"
# swift imports this file by path, as `_swift_external_<hash>`, after putting its directory first on
# sys.path. That folder holds only this plugin, so nothing in it can shadow another module.

logger = logging.getLogger("twinkle_strategy.integrations.swift.plugin")

ENV_PREFIX = "TWINKLE_"
# Every StrategyConfig field is an option: TWINKLE_<NAME> or the --fsdp JSON's "twinkle": {"<name>": ...}.
# The plugin's own defaults where they differ from the strategy's (mixed_precision follows swift's --bf16).
DEFAULTS = {"memory_efficient_init": True}
_SWIFT_OWNED = {"backend": "--ddp_backend"}  # options swift already has a flag for


def option_names() -> list[str]:
    return [name for name in config.option_names() if name not in _SWIFT_OWNED]


def env_var(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def resolve_options(fsdp_options: dict | None = None, environ=None) -> dict[str, Any]:
    """Strategy options from ``TWINKLE_*`` variables, overridden by the ``--fsdp`` JSON's ``"twinkle"`` object."""
    environ = os.environ if environ is None else environ
    names = option_names()
    options: dict[str, Any] = dict(DEFAULTS)
    sources = [(f"environment variable {env_var(k)}", k, environ[env_var(k)]) for k in names if env_var(k) in environ]
    unknown = sorted(set(fsdp_options or {}) - set(names))
    if unknown:
        raise SwiftPluginError(f'--fsdp: unknown key(s) {unknown} in "twinkle"; supported: {sorted(names)}')
    sources += [(f'--fsdp "twinkle": {{"{k}": ...}}', k, v) for k, v in (fsdp_options or {}).items()]
    for where, key, raw in sources:
        try:
            options[key] = config.parse_option(key, raw)
        except (TypeError, ValueError) as exc:
            raise SwiftPluginError(f"{where}={raw!r}: {exc}") from exc
    return options


# ------------------------------------------------------------------ state of this process
_STATE: dict[str, Any] = {"args": None, "fsdp_options": {}, "strategy": None}


def _destroy_process_group() -> None:
    # swift leaves the process group to interpreter teardown. With the strategy's own groups (node groups,
    # point-to-point transfers) gloo's threads could then be destroyed while still joinable: a finished run
    # once ended in "terminate called without an active exception" (SIGABRT). Tear it down while Python runs,
    # as twinkle-sft does through strategy.shutdown().
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def get_strategy():
    """The process's NativeFSDPStrategy, built on first use from the options and swift's arguments."""
    if _STATE["strategy"] is None:
        from twinkle_strategy.strategy import NativeFSDPStrategy

        args = _STATE["args"]
        options = resolve_options(_STATE["fsdp_options"])
        options.setdefault("mixed_precision", _STATE.get("swift_precision", "no"))
        strategy = NativeFSDPStrategy(StrategyConfig(backend=getattr(args, "ddp_backend", None), **options))
        strategy.setup()
        _STATE["strategy"] = strategy
        atexit.register(_destroy_process_group)
        if strategy.is_main_process:
            logger.info("twinkle swift plugin: NativeFSDPStrategy(%s), world_size=%d, nodes=%d",
                        ", ".join(f"{k}={v}" for k, v in options.items()), strategy.world_size,
                        strategy.topology.num_nodes)
    return _STATE["strategy"]


# ------------------------------------------------------------------ 1. arguments
def _check_args(args) -> None:
    if getattr(args, "rlhf_type", None) is not None:
        raise SwiftPluginError("the twinkle plugin supports `swift sft` and `swift pt`, not `swift rlhf`")
    if getattr(args, "sequence_parallel_size", 1) > 1:
        raise SwiftPluginError("--sequence_parallel_size > 1 is not supported with the twinkle plugin; set it to 1")
    packed = [f"--{name} true" for name in ("packing", "padding_free") if getattr(args, name, False)]
    if packed:
        # swift hands packed rows to flash-attention only, and the plugin does not check the model keeps
        # packed examples apart (twinkle_strategy.train.packing does, on every attention backend).
        raise SwiftPluginError(f"{' '.join(packed)} is not served by the twinkle plugin yet; drop it, or train with "
                               "`twinkle-sft ... --packing true` (or --padding_free true), which keeps each packed "
                               "example's attention to itself")
    if getattr(args, "deepspeed", None):
        raise SwiftPluginError("--deepspeed and the twinkle plugin both shard the model; drop --deepspeed")
    if getattr(args, "tuner_type", "lora") not in ("lora", "full"):
        raise SwiftPluginError(f"--tuner_type {args.tuner_type} is not supported with the twinkle plugin; "
                               "use lora (with --target_parameters for expert LoRA) or full")
    if getattr(args, "use_swift_lora", False) or getattr(args, "tuner_backend", "peft") != "peft":
        raise SwiftPluginError("the twinkle plugin needs PEFT LoRA: drop --use_swift_lora/--tuner_backend")
    if args.tuner_type == "lora" and getattr(args, "target_parameters", None):
        # PEFT's ParamWrapper computes W + B@A per expert; these need the adapter applied to activations.
        bad = [(f"--lora_dropout {args.lora_dropout}", "--lora_dropout 0", bool(args.lora_dropout)),
               ("--use_dora true", "--use_dora false", bool(getattr(args, "use_dora", False))),
               (f"--lora_bias {args.lora_bias}", "--lora_bias none", getattr(args, "lora_bias", "none") != "none")]
        for option, fix, is_bad in bad:
            if is_bad:
                raise SwiftPluginError(
                    f"{option} cannot be used with --target_parameters {' '.join(args.target_parameters)} "
                    f"(LoRA on fused expert weights): pass {fix}, or drop --target_parameters")


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


def _init_fsdp(_orig, self) -> None:
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
        _STATE["fsdp_options"] = twinkle
    self.fsdp = []
    self.fsdp_config = None
    _STATE["args"] = self
    resolve_options(_STATE["fsdp_options"])  # option errors now, before any model is loaded
    _check_args(self)
    # Precision is FSDP2's MixedPrecisionPolicy (compute in bf16, reduce gradients in fp32), not accelerate's
    # autocast + GradScaler: a scaler's unscale step would not see our EP-aware clipping.
    _STATE["swift_precision"] = "bf16" if self.bf16 else "no"
    self.bf16 = self.fp16 = False
    from twinkle_strategy.distributed.runtime import (
        apply_backend_env_defaults,
        backend_for,
        detect_device_type,
    )

    device_type = detect_device_type()
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


# ------------------------------------------------------------------ 2. model loading
@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _dtype(config, kwargs):
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _checked_load(from_pretrained, cls, path, *args, **kwargs):
    from twinkle_strategy.checkpoint.durable import raise_if_incomplete
    from twinkle_strategy.loading import raise_for_loading_info

    if os.path.isdir(str(path)):
        raise_if_incomplete(str(path))
    kwargs["device_map"] = None  # CPU: shards go to the devices in wrap_model; no rank holds a whole model there
    want_info = kwargs.pop("output_loading_info", False)
    # swift asks for ignore_mismatched_sizes only where it replaces a head on purpose (reward models); otherwise
    # we ask for it ourselves, so that transformers reports the mismatched tensors and we raise naming them.
    strict = kwargs.get("ignore_mismatched_sizes") is not True
    kwargs["ignore_mismatched_sizes"] = True
    # transformers' own FSDP loading would give every non-local-rank-0 process a zero-filled copy.
    with _env("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"):
        model, info = from_pretrained(cls, path, *args, output_loading_info=True, **kwargs)
    if strict:
        raise_for_loading_info(path, info)
    return (model, info) if want_info else model


@contextlib.contextmanager
def _strategy_from_pretrained(strategy):
    """``PreTrainedModel.from_pretrained`` as the strategy wants it, while swift loads the model."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    from_pretrained = original.__func__

    def patched(cls, path, *args, config=None, **kwargs):
        if not strategy.memory_efficient_init:
            return _checked_load(from_pretrained, cls, path, *args, config=config, **kwargs)
        from twinkle_strategy.loading import init_kwargs, meta_skeleton, open_streaming_model, stream_blocker

        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
        dtype = _dtype(config, kwargs)
        if not strategy.topology.is_source:
            return meta_skeleton(config, dtype, model_class=cls, **init_kwargs(kwargs)).eval()
        # swift asks for ignore_mismatched_sizes where it replaces a head on purpose (reward models): a full load.
        if not strategy.config.stream_checkpoint:
            blocker = "stream_checkpoint=False"
        elif args:
            blocker = "from_pretrained was given positional arguments"
        else:
            blocker = stream_blocker(path, config, {k: v for k, v in kwargs.items() if k != "output_loading_info"})
        if blocker is not None:
            logger.info("twinkle swift plugin: node %d loads %s whole in host memory (%s)",
                        strategy.topology.node_index, path, blocker)
            return _checked_load(from_pretrained, cls, path, *args, config=config, **kwargs)
        model = open_streaming_model(path, config, dtype, model_class=cls, **init_kwargs(kwargs)).eval()
        report = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return (model, report) if kwargs.get("output_loading_info") else model

    PreTrainedModel.from_pretrained = classmethod(patched)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def _load(orig, self):
    if not getattr(self, "load_model", False) or getattr(self, "return_dummy_model", False):
        return orig(self)
    # -> DistributedInitError, as the strategy's own loading
    from twinkle_strategy.distributed.fail_together import raise_init_together as raise_together

    strategy = get_strategy()
    result, error = None, None
    try:
        with _strategy_from_pretrained(strategy):
            result = orig(self)
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    raise_together(error, f"loading {self.model_info.model_dir}")
    if strategy.memory_efficient_init:
        from twinkle_strategy.loading import share_weight_conversions

        share_weight_conversions(result[0] if isinstance(result, tuple) else result, strategy.topology,
                                 strategy.node_group)
    _STATE["loaded_checkpoint"] = not (strategy.memory_efficient_init and not strategy.topology.is_source)
    if strategy.is_main_process:
        where = ("each node's local rank 0 opened it, every rank built the model without weights "
                 "(wrap_model sends each rank its shards)" if strategy.memory_efficient_init
                 else "every rank loaded it on CPU")
        logger.info("twinkle swift plugin: %s: %s", self.model_info.model_dir, where)
    return result


# swift wraps some experts classes' forward while loading (Qwen3-VL-MoE: a cast of the output to the
# input's dtype) in a ``forward(hidden_states, *args, **kwargs)`` that passes everything through but
# hides the signature expert parallelism reads its call contract from. Marking the original as
# ``__wrapped__`` (what functools.wraps would have done) shows it again; swift's cast still runs.
_SWIFT_EXPERTS_PATCHES = {
    "patch_Qwen3VLMoeTextExperts_dtype": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                                          "Qwen3VLMoeTextExperts"),
}


def _expose_wrapped_forward(orig, module_name: str, class_name: str):
    import importlib

    experts_class = getattr(importlib.import_module(module_name), class_name)
    before = experts_class.forward
    result = orig()
    after = experts_class.forward
    if after is not before and not hasattr(after, "__wrapped__"):
        after.__wrapped__ = before
    return result


def _install_experts_patch_hooks() -> None:
    from swift.model.models import qwen

    for function_name, (module_name, class_name) in _SWIFT_EXPERTS_PATCHES.items():
        original = getattr(qwen, function_name, None)
        if original is None or getattr(original, "_twinkle_hook", False):
            continue  # another swift version, or already hooked
        hook = functools.partial(_expose_wrapped_forward, original, module_name, class_name)
        hook._twinkle_hook = True
        setattr(qwen, function_name, hook)


# ------------------------------------------------------------------ 3. tuner, then EP + FSDP2
def _prepare_model(orig, cls, args, model, *pargs, **kwargs):
    from torch.distributed.fsdp import FSDPModule

    from twinkle_strategy.moe.recompute import replay_in_transformers_checkpointing

    if isinstance(model, FSDPModule):
        return orig.__func__(cls, args, model, *pargs, **kwargs)
    strategy = get_strategy()
    # The same fresh adapter whatever the number of nodes: with memory_efficient_init the source's
    # adapter is the one every rank receives, so only its RNG matters; without it all ranks agree.
    torch.manual_seed(args.seed)
    model = orig.__func__(cls, args, model, *pargs, **kwargs)
    model, _ = strategy.wrap_model(model)
    # swift's --gradient_checkpointing goes through transformers' activation checkpointing: make its
    # recomputation replay the EP dispatch (no second all-to-all, no re-routing), as twinkle-sft's does.
    replay_in_transformers_checkpointing(model)
    # Sharded and placed already: accelerate must neither wrap it in DDP nor shard it again.
    mark_accelerate_prepared(model)  # (the strategy has logged its init report already)
    return model


# ------------------------------------------------------------------ 4. trainer
STATE_DIR = "twinkle_state"


def _optimizer_to_local(state_dict: dict) -> dict:
    """swift's resume state, per rank: DTensor states become their local shards (same layout to resume)."""
    return {
        "state": {i: {k: local_tensor(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in state_dict["state"].items()},
        "param_groups": state_dict["param_groups"],
    }


def _optimizer_from_local(local: dict, optimizer) -> dict:
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in local["state"].items():
        p = params[int(i)]
        state[i] = {}
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.dim() > 0:
                v = DTensor.from_local(v.to(local_tensor(p).device), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride())
            state[i][k] = v
    return {"state": state, "param_groups": local["param_groups"]}


class TwinkleTrainerMixin:
    """What swift's trainer needs for a model sharded by NativeFSDPStrategy (placed before swift's class)."""

    @property
    def twinkle_strategy(self):
        return get_strategy()

    def _move_model_to_device(self, model, device):
        pass  # every rank's shards are on its device since wrap_model

    # -- gradient norm: expert gradients live on another mesh than the rest
    def _clip_grad_norm(self, model):
        norm = self.twinkle_strategy.clip_grad_norm_(model, self.args.max_grad_norm)
        if not torch.isfinite(norm):  # like swift: skip this update instead of applying inf/NaN gradients
            for p in model.parameters():
                p.grad = None
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.twinkle_strategy.clip_grad_norm_(model, float("inf"))
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # -- saving: swift's own _save and layout; the weights without a gather
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.tuner_type == "full":
            # Every rank writes its rows straight into the checkpoint's safetensors files (in the layout of
            # the checkpoint the run started from); process zero then lets swift write everything else.
            self.twinkle_strategy.save_pretrained(self.model, output_dir, max_shard_size=self.args.max_shard_size)
            if self.args.should_save:
                trainer_save(self, output_dir, state_dict=None)
        else:
            # The adapter is small: gathered (all experts, as plain PEFT loads it) and written by process zero.
            keys = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = self.twinkle_strategy.full_state_dict(self.model, rank0_only=True, keys=keys)
            if self.args.should_save:
                trainer_save(self, output_dir, state_dict=state)
            del state
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_model(self, output_dir: str | None = None, state_dict=None):
        if self.args.tuner_type == "full":
            return  # written by every rank in save_model, config included
        return super()._save_model(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        strategy = self.twinkle_strategy
        os.makedirs(os.path.join(output_dir, STATE_DIR), exist_ok=True)
        local = {
            "layout": {"world_size": strategy.world_size, "ep_size": strategy.ep_size},
            "params": {n: local_tensor(p.detach()).clone() for n, p in self.model.named_parameters() if p.requires_grad},
            "optimizer": _optimizer_to_local(self.optimizer.state_dict()),
        }
        torch.save(local, os.path.join(output_dir, STATE_DIR, f"rank{strategy.rank}.pt"))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, scheduler_file_name()))

    def _twinkle_local_state(self, checkpoint: str) -> dict:
        from twinkle_strategy.checkpoint import ResumeError

        strategy = self.twinkle_strategy
        path = os.path.join(checkpoint, STATE_DIR, f"rank{strategy.rank}.pt")
        if not os.path.isfile(path):
            if os.path.isdir(os.path.join(checkpoint, STATE_DIR)):
                raise ResumeError(f"{checkpoint} has no {STATE_DIR}/rank{strategy.rank}.pt: it was saved with "
                                  "another world size; resume with the same number of processes")
            return None  # saved with --save_only_model, or not by this plugin
        local = torch.load(path, map_location="cpu", weights_only=False)
        layout = {"world_size": strategy.world_size, "ep_size": strategy.ep_size}
        if local["layout"] != layout:
            raise ResumeError(f"{checkpoint} was saved with {local['layout']}, this run has {layout}; "
                              "resume with the same parallel layout")
        return local

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        local = self._twinkle_local_state(resume_from_checkpoint)
        if local is None:
            if self.args.tuner_type == "full":
                from twinkle_strategy.checkpoint import ResumeError

                raise ResumeError(f"{resume_from_checkpoint} has no {STATE_DIR}/: it was saved with "
                                  "--save_only_model or without the twinkle plugin; start a new run with --model "
                                  f"{resume_from_checkpoint} instead of resuming")
            # The adapter was loaded by swift's tuner before the model was sharded.
            logger.warning("twinkle swift plugin: %s has no %s/: weights from the adapter, fresh optimizer state",
                           resume_from_checkpoint, STATE_DIR)
            return
        params = dict((model or self.model).named_parameters())
        with torch.no_grad():
            for name, tensor in local["params"].items():
                local_tensor(params[name]).copy_(tensor)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or self.args.resume_only_model:
            return
        local = self._twinkle_local_state(checkpoint)
        if local is None:
            return
        self.optimizer.load_state_dict(_optimizer_from_local(local["optimizer"], self.optimizer))
        scheduler = os.path.join(checkpoint, scheduler_file_name())
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))


_TRAINER_CLASSES: dict[type, type] = {}


def _get_trainer_cls(orig, cls, args):
    base = orig.__func__(cls, args)
    if base not in _TRAINER_CLASSES:
        check_trainer_overrides(TwinkleTrainerMixin)
        _TRAINER_CLASSES[base] = type(f"Twinkle{base.__name__}", (TwinkleTrainerMixin, base), {})
    return _TRAINER_CLASSES[base]


# ------------------------------------------------------------------ installing the hooks
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

    _patch(SftArguments, "_init_fsdp", _init_fsdp)
    _patch(ModelLoader, "load", _load)
    _patch(TunerMixin, "prepare_model", _prepare_model, kind="classmethod")
    _patch(TrainerFactory, "get_trainer_cls", _get_trainer_cls, kind="classmethod")
    _install_experts_patch_hooks()


def plugin_path() -> str:
    """The path to pass to ``swift sft --external_plugins``."""
    return os.path.abspath(__file__)


if __name__ != _CANONICAL_NAME and _CANONICAL_NAME not in sys.modules:
    # One module per process, whichever name imported it first: the hooks and the strategy live here.
    sys.modules[_CANONICAL_NAME] = sys.modules[__name__]
try:
    import swift  # noqa: F401
except ImportError:  # imported outside ms-swift (e.g. for plugin_path): nothing to hook
    pass
else:
    install()
