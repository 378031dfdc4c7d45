"""Byte streams: a rank's shards laid end to end, read and written one bucket at a time.

The source never assembles a whole stream (that would be another copy of the
model), nor even a whole region: :class:`StreamReader` copies the next
bucket's worth of bytes out of chunks of rows, read (or viewed) one at a
time, and :class:`StreamWriter` on the receiving side copies a
bucket's bytes into the local shards where they belong.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a copy only if it is not contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


class StreamReader:
    """Reads the concatenated bytes of regions, each produced lazily as a sequence of chunks.

    ``regions[i]()`` returns an iterator of tensors whose bytes, end to end,
    are region ``i`` (``sizes[i]`` bytes). Only the chunk being copied is alive.
    """

    def __init__(self, regions: list[Callable[[], Iterator[torch.Tensor]]], sizes: list[int]):
        self._regions, self._sizes = regions, sizes
        self._index = 0
        self._chunks: Iterator[torch.Tensor] | None = None
        self._chunk: torch.Tensor | None = None
        self._offset = 0  # into the current chunk
        self._region_done = 0  # bytes of the current region already read
        self.total = sum(sizes)

    def _next_chunk(self) -> bool:
        """Advance to the next chunk with bytes; False at the end of the stream."""
        while self._index < len(self._regions):
            if self._chunks is None:
                self._chunks, self._region_done = iter(self._regions[self._index]()), 0
            chunk = next(self._chunks, None)
            if chunk is not None:
                self._chunk, self._offset = as_bytes(chunk), 0
                self._region_done += self._chunk.numel()
                if self._region_done > self._sizes[self._index]:
                    raise AssertionError(f"region {self._index} produced more than its {self._sizes[self._index]} "
                                         "bytes")
                if self._chunk.numel():
                    return True
                continue
            if self._region_done != self._sizes[self._index]:
                raise AssertionError(f"region {self._index} produced {self._region_done} of its "
                                     f"{self._sizes[self._index]} bytes")
            self._index, self._chunks = self._index + 1, None
        return False

    def read_into(self, out: torch.Tensor) -> int:
        """Fill ``out`` (uint8) from the stream; returns the number of stream bytes written."""
        filled = 0
        while filled < out.numel():
            if self._chunk is None or self._offset == self._chunk.numel():
                # Drop our reference first, so the finished chunk is freed before the next is read.
                self._chunk = None
                if not self._next_chunk():
                    break
            take = min(out.numel() - filled, self._chunk.numel() - self._offset)
            out[filled:filled + take].copy_(self._chunk[self._offset:self._offset + take])
            filled += take
            self._offset += take
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
