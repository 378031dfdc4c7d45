"""StrategyConfig: every option of NativeFSDPStrategy, declared once.

The Python API (``NativeFSDPStrategy(config)`` or its keyword arguments), the recipe's ``strategy:``
section, ``twinkle-sft``'s flags and the ms-swift plugin's ``TWINKLE_*`` variables and ``--fsdp``
keys are all built from the fields below, so an option added here appears on every surface with the
same name, default and one-line help. Like ``torch.distributed.fsdp.MixedPrecisionPolicy`` it is a
frozen dataclass: a strategy's options do not change after it is made.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Literal

from twinkle_strategy.errors import ArgumentError, StrategyConfigError, UnknownKeywordError, did_you_mean


class MixedPrecision(str, enum.Enum):
    """FSDP2's compute dtype (``mixed_precision``); gradients are reduced in ``reduce_dtype`` (fp32 by default)."""

    BF16 = "bf16"
    FP16 = "fp16"
    NO = "no"  # compute in the parameters' own dtypes


class InitTransport(str, enum.Enum):
    """How memory_efficient_init moves each node's shards from its source (``init_transport``)."""

    P2P = "p2p"  # paired isend/irecv, exact bytes
    SCATTER = "scatter"  # one collective per round, shorter streams padded


class QuantizedBase(str, enum.Enum):
    """What a rank holds of a quantized release's frozen weights (``quantized_base``)."""

    DEQUANTIZE = "dequantize"  # decoded on arrival into the model's dtype (a plain model)
    KEEP = "keep"  # kept as stored (quantized bytes and scales), decoded just in time for each use


class LoraExperts(str, enum.Enum):
    """How LoRA on fused expert tensors (PEFT's ``target_parameters``) is computed (``lora_experts``)."""

    ACTIVATIONS = "activations"  # x @ W + scale * ((x @ A) @ B) per expert: W + BA is never formed
    PEFT = "peft"  # PEFT's own path: W + scale * BA formed for every local expert in each forward


# torch's names of devices and of the collective backends that go with them.
DeviceType = Literal["cuda", "npu", "cpu"]
Backend = Literal["nccl", "hccl", "gloo"]

# The options' values as users write them (the fields below hold these strings).
MIXED_PRECISION = tuple(mode.value for mode in MixedPrecision)
# Spellings users write for the same three policies (YAML reads a bare `no` as false).
_MIXED_PRECISION_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "fp32": "no", "float32": "no",
                            "false": "no", "False": "no", "none": "no", "None": "no"}
# reduce_dtype: the float dtypes FSDP2 may sum gradients in, by the names users write (dtypes.FLOAT_DTYPES).
REDUCE_DTYPES = ("float32", "bfloat16", "float16")
_REDUCE_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INIT_TRANSPORTS = tuple(kind.value for kind in InitTransport)
QUANTIZED_BASES = tuple(kind.value for kind in QuantizedBase)
LORA_EXPERTS = tuple(kind.value for kind in LoraExperts)
DEVICE_TYPES = typing.get_args(DeviceType)
BACKENDS = typing.get_args(Backend)
DEFAULT_INIT_BUCKET_MB = 256.0


def _option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """The options of :class:`~twinkle_strategy.NativeFSDPStrategy`; each field's ``help`` is its doc."""

    ep_size: int = _option(1, "ranks that split each MoE layer's experts (1 = no expert parallelism); "
                              "divides the world size and the number of experts")
    ep_fsdp_size: int | None = _option(None, "ranks that shard each expert slice; default (and only legal "
                                             "value) world_size / ep_size")
    sequence_parallel_size: int = _option(1, "ranks that split each sequence into contiguous chunks (Ulysses: "
                                             "attention exchanges heads for sequence by all-to-all); divides the "
                                             "world size and the attention heads; those ranks share their examples, in every "
                                             "front-end: global batch = per-device batch x gradient accumulation "
                                             "x world size / sequence_parallel_size")
    mixed_precision: str = _option("bf16", "bf16 | fp16 | no: FSDP2 compute dtype; gradients are reduced in "
                                           "reduce_dtype and fp32-kept modules stay fp32")
    reduce_dtype: str = _option("float32", "float32 | bfloat16 | float16: the dtype FSDP2 sums gradients across "
                                           "ranks in, under bf16/fp16 mixed precision; bfloat16 halves the reduce's "
                                           "bytes and skips the cast of every gradient to fp32, at a bf16 rounding "
                                           "per rank summed (docs/strategy.md); with mixed_precision 'no', float32 "
                                           "reduces each gradient in its parameter's own dtype")
    reshard_after_forward: bool = _option(True, "free gathered parameters after each forward (FSDP2's "
                                                "reshard_after_forward); false trades memory for speed")
    memory_efficient_init: bool = _option(False, "only each node's local rank 0 reads the checkpoint; every "
                                                 "other rank receives exactly its shards from it")
    stream_checkpoint: bool = _option(True, "with memory_efficient_init: read from the files only the rows "
                                            "each node keeps (false: load the whole model on each source)")
    init_bucket_mb: float = _option(DEFAULT_INIT_BUCKET_MB, "memory_efficient_init transfer bucket size (MiB)")
    init_transport: str = _option("p2p", "p2p (paired isend/irecv, exact bytes) | scatter (one collective "
                                         "per round, shorter streams padded)")
    verify_init: bool = _option(False, "after memory_efficient_init, check a CRC32 of every received region "
                                       "against the source's")
    quantized_base: str = _option("dequantize", "dequantize | keep: with memory_efficient_init from a quantized "
                                                "release (FP8 blocks, DeepSeek-V4 FP4, MXFP4), keep the frozen "
                                                "quantized weights as stored and dequantize them just in time "
                                                "(LoRA over the release); dequantize holds them in the model dtype")
    lora_experts: str = _option("activations", "activations | peft: how LoRA on fused expert tensors "
                                               "(PEFT target_parameters) is computed; activations adds "
                                               "scale * (x @ A) @ B to each expert's output and never forms "
                                               "W + BA (LoRA's memory); peft is PEFT's own path, which forms "
                                               "W + BA for every local expert in each forward")
    timeout_s: float = _option(1800.0, "seconds any collective may wait for a peer before every rank fails "
                                       "with an error naming it")
    device_type: str | None = _option(None, "cuda | npu | cpu; detected when unset")
    backend: str | None = _option(None, "nccl | hccl | gloo; the device's own when unset")

    def __post_init__(self) -> None:
        mixed = _MIXED_PRECISION_ALIASES.get(str(self.mixed_precision), self.mixed_precision)
        object.__setattr__(self, "mixed_precision", mixed)  # frozen: normalise the spelling once, here
        _check(self, "ep_size", self.ep_size >= 1, "use a positive integer")
        _check(self, "sequence_parallel_size", self.sequence_parallel_size >= 1, "use a positive integer")
        _check(self, "ep_fsdp_size", self.ep_fsdp_size is None or self.ep_fsdp_size >= 1,
               "use a positive integer, or leave it unset")
        _check(self, "mixed_precision", mixed in MIXED_PRECISION, f"use one of {MIXED_PRECISION}")
        reduce = _REDUCE_DTYPE_ALIASES.get(str(self.reduce_dtype), self.reduce_dtype)
        object.__setattr__(self, "reduce_dtype", reduce)
        _check(self, "reduce_dtype", reduce in REDUCE_DTYPES,
               "use a float dtype: float32 (the default), bfloat16 or float16")
        _check(self, "init_bucket_mb", self.init_bucket_mb > 0, "use a positive size in MiB")
        _check(self, "init_transport", self.init_transport in INIT_TRANSPORTS, f"use one of {INIT_TRANSPORTS}")
        _check(self, "quantized_base", self.quantized_base in QUANTIZED_BASES, f"use one of {QUANTIZED_BASES}")
        # Only the streamed init sees the stored bytes; a model loaded whole is dequantized by transformers.
        _check(self, "quantized_base", self.quantized_base == QuantizedBase.DEQUANTIZE
               or (self.memory_efficient_init and self.stream_checkpoint),
               "keep needs memory_efficient_init=true and stream_checkpoint=true (the release's bytes reach the "
               "ranks only through the streamed init); set them, or use quantized_base=dequantize")
        _check(self, "lora_experts", self.lora_experts in LORA_EXPERTS, f"use one of {LORA_EXPERTS}")
        _check(self, "timeout_s", self.timeout_s > 0, "use a positive number of seconds")
        _check(self, "device_type", self.device_type in (None, *DEVICE_TYPES), f"use one of {DEVICE_TYPES}")
        _check(self, "backend", self.backend in (None, *BACKENDS), f"use one of {BACKENDS}")

    @property
    def init_bucket_bytes(self) -> int:
        return int(self.init_bucket_mb * 2**20)

    def replace(self, **changes: Any) -> StrategyConfig:
        refuse_unknown_options(changes)
        return dataclasses.replace(self, **changes)


def _check(config: StrategyConfig, name: str, ok: bool, fix: str) -> None:
    if not ok:
        raise StrategyConfigError(name, f"{name}={getattr(config, name)!r} is not valid: {fix}")


def refuse_unknown_options(options: typing.Mapping[str, Any]) -> None:
    """A misspelt option (``ep_sise=2``) as one line naming the closest option, not the dataclass's TypeError."""
    for name in options:
        if name not in option_names():
            hint = did_you_mean(name, option_names()) or f"the options are {', '.join(option_names())}"
            raise UnknownKeywordError(f"NativeFSDPStrategy has no option {name}=; {hint}")


def option_names() -> list[str]:
    return [field.name for field in dataclasses.fields(StrategyConfig)]


def option_help(name: str) -> str:
    return _field(name).metadata["help"]


def option_default(name: str) -> Any:
    return _field(name).default


def parse_option(name: str, raw: Any) -> Any:
    """``raw`` (an environment variable's text, a JSON value) as the type of option ``name``."""
    kind = _value_type(name)
    if raw is None or (isinstance(raw, str) and raw.strip() in ("", "none", "None", "null")):
        if _optional(name):
            return None
        raise StrategyConfigError(name, f"{name} needs a {kind.__name__}, got {raw!r}")
    if kind is bool:
        return parse_bool(raw)
    return kind(raw)


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
               "off": False}


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _BOOL_WORDS:
        raise ArgumentError(f"expected true/false, got {value!r}")
    return _BOOL_WORDS[word]


def _field(name: str) -> dataclasses.Field:
    for field in dataclasses.fields(StrategyConfig):
        if field.name == name:
            return field
    raise StrategyConfigError(name, f"unknown strategy option {name!r}; the options are {option_names()}")


def _value_type(name: str) -> type:
    hint = typing.get_type_hints(StrategyConfig)[name]
    return next(arg for arg in typing.get_args(hint) if arg is not type(None)) if _optional(name) else hint


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(StrategyConfig)[name])
