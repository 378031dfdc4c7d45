"""The model every rank builds before any weight is read: the real class, names and shapes, no weights.

With memory_efficient_init every rank builds the model from its config on
the meta device, so no rank ever holds the whole model; ``wrap_model`` later
fills each rank's shards. Each checkpoint-backed parameter and persistent
buffer becomes a :class:`CheckpointTensor`, a placeholder that knows which
model tensor of which checkpoint it stands for:

* On a node's source it reports the CPU device, so what the user does between
  ``from_pretrained`` and ``wrap_model`` runs as on a model in host memory:
  PEFT creates LoRA adapters on the CPU with real values (the same values a
  single process gets for the same seed), ``PeftModel.from_pretrained`` loads
  saved adapters into them, a new head is a real tensor. ``wrap_model`` keeps
  those tensors by reference and reads the placeholders' rows from the files.
* On every other rank it reports the meta device: adapters and heads stay
  on meta and cost nothing; their values come from the source.

Any computation on a placeholder raises :class:`WeightsNotLoadedError` on
every rank alike (so no rank waits for one that failed), instead of silently
computing on zeros or on nothing.

Non-persistent buffers (RoPE ``inv_freq`` ...) are not in checkpoints: the
source recomputes them the way ``from_pretrained`` does, with the model's
own ``_init_weights``, and sends them to its node.
"""

from __future__ import annotations

import torch
from torch import nn

from twinkle_strategy.compat import transformers_internals as hf
from twinkle_strategy.compat.torch_internals import (
    buffer_slots,
    disabled_torch_function,
    make_wrapper_subclass,
    non_persistent_buffer_names,
    parameter_slots,
)
from twinkle_strategy.dtypes import apply_kept_dtypes
from twinkle_strategy.errors import CheckpointError, WeightsNotLoadedError

aten = torch.ops.aten


class CheckpointTensor(torch.Tensor):
    """A placeholder for model tensor ``key`` of the checkpoint ``layout`` (None on ranks that never read it)."""

    key: str  # the model tensor it stands for
    checkpoint: object  # the CheckpointLayout to read it from (None where this rank never reads)

    @staticmethod
    def __new__(cls, key: str, layout, shape, dtype: torch.dtype, device: torch.device | str):
        tensor = make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        tensor.key, tensor.checkpoint = key, layout
        return tensor

    __torch_function__ = disabled_torch_function()

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"CheckpointTensor('{self.key}', shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in args if isinstance(a, CheckpointTensor))
        if func in (aten.detach.default, aten.alias.default):
            # nn.Parameter(...), state_dict() and requires_grad_ go through detach: same placeholder.
            return CheckpointTensor(first.key, first.checkpoint, first.shape, first.dtype, first.device)
        raise WeightsNotLoadedError(
            f"'{first.key}' has no values yet ({func} was called on it): with memory_efficient_init the "
            "checkpoint is read inside strategy.wrap_model, each rank reading only its shard. Do this after "
            "wrap_model, or load the whole model in host memory with "
            "NativeFSDPStrategy(..., stream_checkpoint=False)")


def build_meta_model(model_class, config, dtype: torch.dtype, **init_kwargs) -> nn.Module:
    """``model_class`` built from ``config`` on the meta device: every name, shape and dtype, no memory.

    Each tensor gets the dtype ``from_pretrained(dtype=dtype)`` gives it: ``from_config`` ignores the
    model's fp32-kept modules (DeepSeek's router bias, Ernie-4.5's router), so they are applied here.
    """
    # Auto classes build with from_config, concrete classes (as ms-swift passes them) with _from_config.
    with torch.device("meta"):
        model = hf.build_from_config(model_class, config, dtype=dtype, **init_kwargs)
    return apply_kept_dtypes(model, dtype)


def install_placeholders(model: nn.Module, layout=None) -> nn.Module:
    """Replace every parameter and persistent buffer of the meta ``model`` by a :class:`CheckpointTensor`.

    ``layout`` (a :class:`twinkle_strategy.checkpoint.layout.CheckpointLayout`)
    is given on a node's source only: its placeholders report the CPU device
    and its non-persistent buffers are computed. Elsewhere they stay on meta.
    """
    if layout is not None:
        compute_non_persistent_buffers(model)
    device = torch.device("cpu") if layout is not None else torch.device("meta")
    originals = list(model.named_parameters(remove_duplicate=False)) + _persistent_buffers(model)
    names: dict[int, list[str]] = {}
    for name, tensor in originals:
        names.setdefault(id(tensor), []).append(name)
    # Memoised by identity (``originals`` keeps the ids valid): tied tensors stay one tensor.
    replaced: dict[int, torch.Tensor] = {}

    def replacement(tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(tensor) not in replaced:
            aliases = names[id(tensor)]
            # A tied group is stored under one of its names; take the one the checkpoint has.
            key = next((n for n in aliases if layout is not None and n in layout.recipes), aliases[0])
            value = CheckpointTensor(key, layout, tensor.shape, tensor.dtype, device)
            replaced[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value
        return replaced[id(tensor)]

    for module in model.modules():
        params, buffers = parameter_slots(module), buffer_slots(module)
        for key, param in list(params.items()):
            if param is not None:
                params[key] = replacement(param, is_param=True)
        for key, buf in list(buffers.items()):
            if buf is not None and key not in non_persistent_buffer_names(module):
                buffers[key] = replacement(buf, is_param=False)
    del originals
    return model


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for key, buf in buffer_slots(module).items():
            if buf is not None and key not in non_persistent_buffer_names(module):
                out.append((f"{module_name}.{key}" if module_name else key, buf))
    return out


def compute_non_persistent_buffers(model: nn.Module) -> None:
    """Give every non-persistent buffer (RoPE ``inv_freq`` ...) its value on the CPU, as ``from_pretrained`` does.

    transformers builds models on meta and then lets each module's
    ``_init_weights`` compute these buffers; we do the same for the modules that
    own one (their parameters are still on meta, so nothing else is touched).
    """
    from transformers import PreTrainedModel

    owners = {}
    for name, module in model.named_modules():
        buffers = buffer_slots(module)
        for key in non_persistent_buffer_names(module):
            buf = buffers.get(key)
            if buf is None:
                continue
            # NaN marks "not computed" so a buffer _init_weights does not know is caught below.
            fill = float("nan") if buf.is_floating_point() else 0
            buffers[key] = torch.full(buf.shape, fill, dtype=buf.dtype, device="cpu")
            owners[name] = module
    pretrained = {n: m for n, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    for name, module in owners.items():
        nearest = max((p for p in pretrained if p == "" or name == p or name.startswith(p + ".")), key=len)
        hf.init_weights(pretrained[nearest], module)
    for name, module in owners.items():
        for key in non_persistent_buffer_names(module):
            buf = buffer_slots(module).get(key)
            if buf is not None and buf.is_floating_point() and torch.isnan(buf).any():
                raise CheckpointError(
                    f"buffer '{name}.{key}' ({type(module).__name__}) is not in the checkpoint and transformers' "
                    "_init_weights does not compute it, so it cannot be streamed; load the model in host memory "
                    "with NativeFSDPStrategy(..., stream_checkpoint=False)")
