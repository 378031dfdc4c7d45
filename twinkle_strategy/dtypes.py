"""Dtypes: their names (safetensors', and those users write in recipes and flags), :class:`TensorSpec`, and the
tensors transformers keeps in another dtype than the one requested, asked of transformers itself.

``from_pretrained(dtype=torch.bfloat16)`` does not give every tensor bf16:

* a model class may list modules to keep in fp32 (``_keep_in_fp32_modules_strict``
  under bf16 and fp16, ``_keep_in_fp32_modules`` under fp16 only): DeepSeek-V3's
  router ``e_score_correction_bias``, DeepSeek-V4's norms, sinks and
  hyper-connections, Ernie-4.5's router ``gate.weight``;
* a module may create a parameter in a fixed dtype (HunYuan-MoE's router ``wg``
  in fp32), which loading keeps.

``from_config(dtype=...)`` honours the second but not the first, so a model built
from its config (the streaming skeleton, the meta model of ranks that never read
the checkpoint) must apply the list itself (:func:`apply_kept_dtypes`), and FSDP2,
which needs one dtype per ``fully_shard`` unit and would cast a router to bf16 under
a bf16 mixed-precision policy, must know which parameters to leave alone
(:func:`kept_parameters`). The list always comes from the model class: no family
is named here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from twinkle_strategy.compat import transformers_internals as hf
from twinkle_strategy.compat.torch_internals import buffer_slots, parameter_slots
from twinkle_strategy.errors import TwinkleError

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's ue8m0 scales
    "C64": torch.complex64,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# What recipes (model.dtype, swift's --torch_dtype) and mixed-precision options call floating dtypes.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def float_dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` for 'bfloat16' or 'bf16', and so on; a clear error for anything else."""
    if name not in FLOAT_DTYPES:
        raise TwinkleError(f"dtype {name!r} is not one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


class TensorSpec(NamedTuple):
    """A tensor's shape and dtype, without its bytes: what planning, checks and file layouts work from."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor) -> TensorSpec:
        """The spec of ``tensor`` (or of anything with a ``shape`` and a ``dtype``: a header entry, a placeholder)."""
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# -- the tensors transformers keeps in another dtype (fp32 routers, norms, sinks under bf16)
_LOWER_PRECISION = (torch.float16, torch.bfloat16)


def pretrained_model(model: nn.Module):
    """The outermost transformers ``PreTrainedModel`` in ``model`` (a PEFT model holds one), or None."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def loaded_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the transformers model in ``model`` was asked for (``from_pretrained``/``from_config`` record it
    in its config), or None."""
    dtype = getattr(getattr(pretrained_model(model), "config", None), "dtype", None)
    return FLOAT_DTYPES.get(str(dtype).removeprefix("torch.")) if dtype is not None else None


def dtype_plan(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Name pattern -> dtype that ``from_pretrained(dtype=dtype)`` uses for ``model``'s class.

    Asked of transformers (:func:`twinkle_strategy.compat.transformers_internals.dtype_plan`): it is
    the one place transformers decides this (which list applies to which requested dtype, merged over
    sub-models, read from the instance because instances may change the lists); copying its rules
    would drift from the installed version.
    """
    pretrained = pretrained_model(model)
    if pretrained is None or dtype not in _LOWER_PRECISION:
        return {}
    return hf.dtype_plan(pretrained, dtype)


def kept_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Model tensor name (parameters and persistent buffers) -> the dtype ``from_pretrained(dtype=dtype)``
    gives it, for each tensor its dtype plan keeps in another dtype."""
    return {name: kept for name, (kept, _) in _matches(model, dtype).items()}


def kept_reasons(model: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """Why ``from_pretrained(dtype=dtype)`` gives each kept tensor its dtype, in words, by tensor name."""
    matches = _matches(model, dtype)
    if not matches:
        return {}
    pretrained = pretrained_model(model)
    strict = hf.keep_in_fp32_strict(pretrained)
    return {name: (f"from_pretrained(dtype={dtype}) keeps it in {kept}: {type(pretrained).__name__}."
                   f"{'_keep_in_fp32_modules_strict' if glob in strict else '_keep_in_fp32_modules'} has '{glob}'")
            for name, (kept, glob) in matches.items()}


def _matches(model: nn.Module, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, str]]:
    plan = dtype_plan(model, dtype)
    if not plan:
        return {}
    # Matched as core_model_loading.convert_and_load_state_dict_in_model matches them: one alternation of the
    # plan's globs, searched (not anchored) in each model tensor name, the last matching group deciding.
    alternation, glob_of_group = hf.glob_alternation(list(plan))
    found = {}
    for name in pretrained_model(model).state_dict(keep_vars=True):
        match = alternation.search(name)
        if match is not None and match.lastgroup is not None:
            glob = glob_of_group[match.lastgroup]
            found[name] = (plan[glob], glob)
    return found


def apply_kept_dtypes(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Give each tensor of the meta ``model`` (built from its config in ``dtype``) the dtype ``from_pretrained``
    would give it; tied tensors stay one tensor."""
    kept = kept_dtypes(model, dtype)
    converted: dict[int, torch.Tensor] = {}  # by identity, so that tied tensors stay tied
    for name, slots, key in _tensor_slots(pretrained_model(model)) if kept else ():
        tensor = slots[key]
        if name in kept and tensor.dtype != kept[name]:
            if id(tensor) not in converted:
                converted[id(tensor)] = _meta_in(tensor, kept[name])
            slots[key] = converted[id(tensor)]
    return model


def _tensor_slots(model: nn.Module):
    """(full name, the dict holding it, its key) of every parameter and buffer, shared ones under each name."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for slots in (parameter_slots(module), buffer_slots(module)):
            for key, tensor in list(slots.items()):
                if tensor is not None:
                    yield (f"{module_name}.{key}" if module_name else key), slots, key


def _meta_in(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not tensor.is_meta:
        raise AssertionError("apply_kept_dtypes changes meta models only (a loaded tensor would lose its values)")
    value = torch.empty(tensor.shape, dtype=dtype, device="meta")
    return nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value


def kept_parameters(model: nn.Module, compute_dtype: torch.dtype) -> set[int]:
    """Ids of the parameters FSDP2 must leave in their own dtype when the model computes in ``compute_dtype``.

    Those transformers keeps in fp32 for that dtype (its dtype plan), and every other parameter of the
    transformers model that is not in the dtype the model was loaded in (a router created in fp32).
    Adapter parameters (PEFT keeps LoRA weights in fp32 in a bf16 model) follow the model's policy.
    """
    pretrained, loaded = pretrained_model(model), loaded_dtype(model)
    if pretrained is None:
        return set()
    kept_names = set(kept_dtypes(model, compute_dtype))
    adapters = _adapter_parameters(model)
    ids = set()
    for name, param in pretrained.named_parameters():
        other_dtype = loaded is not None and param.is_floating_point() and param.dtype != loaded
        if id(param) not in adapters and (name in kept_names or other_dtype):
            ids.add(id(param))
    return ids


def _adapter_parameters(model: nn.Module) -> set[int]:
    # PEFT's tuner layers (and modules_to_save wrappers) name the containers of their adapter weights.
    ids = set()
    for module in model.modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            container = getattr(module, attr, None)
            if isinstance(container, nn.Module):
                ids |= {id(p) for p in container.parameters()}
    return ids
