"""Where the experts sit inside a tensor, and how to cut and rejoin them.

A fused expert tensor holds all E experts along one dimension, but not always
as contiguous blocks. Transformers stores ``gate_up_proj`` as ``[E, 2I, H]``
(expert-major); PEFT's expert LoRA stores ``lora_A`` as ``[E*r, in]`` (expert
blocks of r rows) and ``lora_B`` as ``[out, r*E]`` with the *expert index
varying fastest* (PEFT reshapes it to ``[out, r, E]``). :class:`ExpertAxis`
describes all three the same way: dimension ``dim`` is viewed as
``(outer, num_experts, inner)``. Cutting experts ``[start, start+count)`` keeps
the ``outer``/``inner`` structure, so the cut tensor is laid out exactly as if
the model had been built with ``count`` experts.

Pure tensor arithmetic: no process groups, usable on meta tensors, unit-testable.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ExpertAxis:
    dim: int
    num_experts: int
    outer: int = 1
    inner: int = 1

    def _split_shape(self, shape: torch.Size | tuple[int, ...], experts: int) -> tuple[int, ...]:
        expected = self.outer * experts * self.inner
        if shape[self.dim] != expected:
            raise ValueError(
                f"dimension {self.dim} of shape {tuple(shape)} should hold "
                f"{self.outer} x {experts} experts x {self.inner} = {expected} entries"
            )
        return tuple(shape[: self.dim]) + (self.outer, experts, self.inner) + tuple(shape[self.dim + 1 :])

    def local_shape(self, full_shape: torch.Size | tuple[int, ...], count: int) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.outer * count * self.inner
        return tuple(shape)

    def cut(self, tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Experts ``[start, start+count)`` of ``tensor`` (a view when possible, never a copy of the rest)."""
        split = tensor.reshape(self._split_shape(tensor.shape, self.num_experts))
        part = split.narrow(self.dim + 1, start, count)
        return part.reshape(self.local_shape(tensor.shape, count))

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`cut` over consecutive expert ranges: ``join([cut(t,0,k), cut(t,k,k)...]) == t``."""
        counts = [p.shape[self.dim] // (self.outer * self.inner) for p in parts]
        split = [p.reshape(self._split_shape(p.shape, c)) for p, c in zip(parts, counts)]
        joined = torch.cat(split, dim=self.dim + 1)
        return joined.reshape(self.local_shape(parts[0].shape, sum(counts)))
