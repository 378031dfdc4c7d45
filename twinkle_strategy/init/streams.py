"""Byte streams: a rank's shards laid end to end, read and written one bucket at a time.

The source never assembles a whole stream (that would be another copy of the
model): :class:`StreamReader` copies the next bucket's worth of bytes out of
the captured tensors, and :class:`StreamWriter` on the receiving side copies a
bucket's bytes into the local shards where they belong.
"""

from __future__ import annotations

from typing import Callable

import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a copy only if it is not contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


class StreamReader:
    """Reads the concatenated bytes of regions produced lazily by ``region_fns``."""

    def __init__(self, region_fns: list[Callable[[], torch.Tensor]], sizes: list[int]):
        self._fns, self._sizes = region_fns, sizes
        self._index, self._offset = 0, 0
        self._current: torch.Tensor | None = None
        self.total = sum(sizes)

    def read_into(self, out: torch.Tensor) -> int:
        """Fill ``out`` (uint8) from the stream; returns the number of stream bytes written."""
        filled = 0
        while filled < out.numel() and self._index < len(self._fns):
            if self._current is None:
                self._current = as_bytes(self._fns[self._index]())
            take = min(out.numel() - filled, self._sizes[self._index] - self._offset)
            out[filled:filled + take].copy_(self._current[self._offset:self._offset + take])
            filled += take
            self._offset += take
            if self._offset == self._sizes[self._index]:
                # Drop our reference so a temporary (non-contiguous region) is freed at once.
                self._index, self._offset, self._current = self._index + 1, 0, None
        return filled


class StreamWriter:
    """Writes consecutive stream bytes into ``targets`` (contiguous tensors), in order."""

    def __init__(self, targets: list[torch.Tensor]):
        self._targets = [as_bytes_view(t) for t in targets]
        self._index, self._offset = 0, 0
        self.total = sum(t.numel() for t in self._targets)

    def write(self, chunk: torch.Tensor) -> int:
        used = 0
        while used < chunk.numel() and self._index < len(self._targets):
            target = self._targets[self._index]
            take = min(chunk.numel() - used, target.numel() - self._offset)
            target[self._offset:self._offset + take].copy_(chunk[used:used + take])
            used += take
            self._offset += take
            if self._offset == target.numel():
                self._index, self._offset = self._index + 1, 0
        return used


def as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 *view* (writes go to ``tensor``); the tensor must be contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("destination shard is not contiguous")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.view(-1).view(torch.uint8)
