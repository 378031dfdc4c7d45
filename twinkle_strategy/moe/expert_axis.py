"""Where the experts sit inside a tensor, and how to cut and rejoin them.

A fused expert tensor holds all E experts along one dimension, but not always
as contiguous blocks. Transformers stores ``gate_up_proj`` as ``[E, 2I, H]``
(expert-major; Llama-4's ``[E, H, 2I]`` too); PEFT's expert LoRA stores
``lora_A`` as ``[E*r, in]`` (expert blocks of r rows) and ``lora_B`` as
``[out, r*E]`` with the *expert index varying fastest* (PEFT reshapes it to
``[out, r, E]``). :class:`ExpertAxis` describes all three the same way:
dimension ``dim`` is viewed as ``(outer, num_experts, inner)``. Cutting experts
``[start, start+count)`` keeps the ``outer``/``inner`` structure, so the cut
tensor is laid out exactly as if the model had been built with ``count``
experts.

LongCat-Flash adds *zero-computation* experts: its ``gate_up_proj`` stores
``num_experts`` routed experts followed by ``zero_experts`` slots that the
forward never reads (those experts are the identity). They are not dispatched,
but the tensor must still round-trip, so each EP rank stores an equal share of
them after its routed experts: the cut of routed experts ``[start,
start+count)`` also takes zero slots ``[start*Z/E, (start+count)*Z/E)``.

Pure tensor arithmetic: no process groups, usable on meta tensors, unit-testable.
"""

from __future__ import annotations

import dataclasses

import torch

from twinkle_strategy.errors import ParallelConfigError


@dataclasses.dataclass(frozen=True)
class ExpertAxis:
    dim: int
    num_experts: int
    outer: int = 1
    inner: int = 1
    zero_experts: int = 0  # LongCat-Flash: never-computed slots stored after the routed experts

    def _zero_share(self, count: int) -> int:
        """How many zero-expert slots go with ``count`` routed experts."""
        share, remainder = divmod(count * self.zero_experts, self.num_experts)
        if remainder:
            raise ParallelConfigError(
                f"{count} of {self.num_experts} routed experts do not carry a whole share of the "
                f"{self.zero_experts} zero-computation experts; the EP size must divide both"
            )
        return share

    def _slots(self, count: int) -> int:
        """Entries along the expert axis for ``count`` routed experts (their zero slots included)."""
        return count + self._zero_share(count) if self.zero_experts else count

    def _split_shape(self, shape: torch.Size | tuple[int, ...], count: int) -> tuple[int, ...]:
        slots = self._slots(count)
        expected = self.outer * slots * self.inner
        if shape[self.dim] != expected:
            raise ValueError(
                f"dimension {self.dim} of shape {tuple(shape)} should hold "
                f"{self.outer} x {slots} experts x {self.inner} = {expected} entries"
            )
        return tuple(shape[: self.dim]) + (self.outer, slots, self.inner) + tuple(shape[self.dim + 1 :])

    def local_shape(self, full_shape: torch.Size | tuple[int, ...], count: int) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.outer * self._slots(count) * self.inner
        return tuple(shape)

    def slots(self, start: int, count: int) -> list[int]:
        """Positions along the expert axis (of the full tensor) that the cut of experts ``[start, start+count)``
        keeps, in its order: the routed experts, then their share of zero-computation slots."""
        routed = list(range(start, start + count))
        if not self.zero_experts:
            return routed
        first_zero = self.num_experts + self._zero_share(start)
        return routed + list(range(first_zero, first_zero + self._zero_share(count)))

    def cut(self, tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Experts ``[start, start+count)`` of ``tensor`` (a view when possible, never a copy of the rest)."""
        split = tensor.reshape(self._split_shape(tensor.shape, self.num_experts))
        axis = self.dim + 1
        if self.zero_experts:  # two ranges: a (small) copy
            index = torch.tensor(self.slots(start, count), device=tensor.device)
            part = split.index_select(axis, index)
        else:
            part = split.narrow(axis, start, count)
        return part.reshape(self.local_shape(tensor.shape, count))

    def row_runs(self, start: int, count: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Rows ``[lo, hi)`` of the cut of experts ``[start, start+count)`` as runs of rows of the full tensor,
        in order (their concatenation is those rows). Only for ``dim == 0``: one run for plain experts, two with
        LongCat's zero-computation slots, one per ``outer`` index otherwise."""
        if self.dim != 0:
            raise ValueError("rows of a cut are runs of rows of the full tensor only when the experts are on dim 0")
        blocks: list[tuple[int, int]] = []  # (first slot in the full tensor, slots) of each run of kept slots
        for slot in self.slots(start, count):
            if blocks and blocks[-1][0] + blocks[-1][1] == slot:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + 1)
            else:
                blocks.append((slot, 1))
        local_slots, full_slots = self._slots(count), self._slots(self.num_experts)
        runs: list[tuple[int, int]] = []
        for outer in range(self.outer):
            local_first, full_first = outer * local_slots * self.inner, outer * full_slots * self.inner
            for slot, n in blocks:
                # Local rows [a, b) of this block are full rows [a + shift, b + shift).
                a, b = local_first, local_first + n * self.inner
                shift = full_first + slot * self.inner - a
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    if runs and runs[-1][1] == a + shift:
                        runs[-1] = (runs[-1][0], b + shift)
                    else:
                        runs.append((a + shift, b + shift))
                local_first += n * self.inner
        return runs

    def _count_of(self, part: torch.Tensor) -> int:
        """Routed experts held by a cut ``part`` (inverse of :meth:`local_shape`)."""
        slots = part.shape[self.dim] // (self.outer * self.inner)
        return slots * self.num_experts // (self.num_experts + self.zero_experts)

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`cut` over consecutive expert ranges: ``join([cut(t,0,k), cut(t,k,k)...]) == t``."""
        counts = [self._count_of(p) for p in parts]
        split = [p.reshape(self._split_shape(p.shape, c)) for p, c in zip(parts, counts, strict=True)]
        axis = self.dim + 1
        routed = [s.narrow(axis, 0, c) for s, c in zip(split, counts, strict=True)]
        zeros = ([s.narrow(axis, c, s.shape[axis] - c) for s, c in zip(split, counts, strict=True)]
                 if self.zero_experts else [])
        joined = torch.cat(routed + zeros, dim=axis)
        return joined.reshape(self.local_shape(parts[0].shape, sum(counts)))
