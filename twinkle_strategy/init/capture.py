"""The source's pre-EP state, held by reference, and models turned into meta.

The source keeps a reference to every parameter and buffer of the model as
loaded (no copy: that would double host memory), then turns its model into a
meta model like every other rank's, so all ranks run the same EP and FSDP code
on meta tensors. The capture is released when distribution ends.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Capture:
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def release(self) -> None:
        self.tensors.clear()


def capture_state(model: nn.Module) -> Capture:
    """References to every parameter and buffer (non-persistent ones such as RoPE ``inv_freq`` too)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensors[name] = param.detach()
    for name, buf in model.named_buffers():
        tensors[name] = buf.detach()
    return Capture(tensors)


def move_to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor, keeping shared ones shared.

    ``model.to("meta")`` would give each module its own copy of a tied
    parameter (e.g. ``lm_head.weight`` tied to ``embed_tokens.weight``);
    memoising by identity keeps ties and buffer aliases as the model had them.
    """
    converted: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                    requires_grad=param.requires_grad)
            module._parameters[key] = converted[id(param)]
        for key, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if id(buf) not in converted:
                converted[id(buf)] = torch.empty_like(buf, device="meta")
            module._buffers[key] = converted[id(buf)]


def buffer_alias_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, buffer name) that share one tensor; ``to_empty`` would split them apart."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                groups.setdefault(id(buf), []).append((module, key))
    return [g for g in groups.values() if len(g) > 1]


def restore_buffer_aliases(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for group in groups:
        first_module, first_key = group[0]
        shared = first_module._buffers[first_key]
        for module, key in group[1:]:
            module._buffers[key] = shared
