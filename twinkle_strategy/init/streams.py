"""Byte streams: a rank's shards laid end to end, read and written one bucket at a time.

The source never assembles a whole stream (that would be another copy of the
model), nor even a whole region: :class:`StreamReader` copies the next
bucket's worth of bytes out of chunks of rows, read (or viewed) one at a
time, and :class:`StreamWriter` on the receiving side copies a
bucket's bytes into the local shards where they belong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a copy only if it is not contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


class StreamReader:
    """Reads the concatenated bytes of regions, each produced lazily as a sequence of chunks.

    ``regions[i]()`` returns an iterator of tensors whose bytes, end to end,
    are region ``i`` (``sizes[i]`` bytes). Only the chunk being copied is
    alive; reading overlaps sending because the transport reads in a thread
    of its own (:mod:`twinkle_strategy.init.send_pool`).
    """

    def __init__(self, regions: list[Callable[[], Iterator[torch.Tensor]]], sizes: list[int]):
        self.total = sum(sizes)
        self._chunks = _checked_chunks(regions, sizes)
        self._chunk: torch.Tensor | None = None
        self._offset = 0  # into the current chunk

    def _next_chunk(self) -> bool:
        """Advance to the next chunk with bytes; False at the end of the stream."""
        for chunk in self._chunks:
            self._chunk, self._offset = as_bytes(chunk), 0
            if self._chunk.numel():
                return True
        return False

    def read_into(self, out: torch.Tensor) -> int:
        """Fill ``out`` (uint8) from the stream; returns the number of stream bytes written."""
        filled = 0
        while filled < out.numel():
            if self._chunk is None:
                if not self._next_chunk():
                    break
            take = min(out.numel() - filled, self._chunk.numel() - self._offset)
            out[filled:filled + take].copy_(self._chunk[self._offset:self._offset + take])
            filled += take
            self._offset += take
            if self._offset == self._chunk.numel():
                self._chunk = None  # used up: freed now, not when the next bucket is read
        return filled


def _checked_chunks(regions, sizes) -> Iterator[torch.Tensor]:
    """Every region's chunks in order, checking that each region produces exactly its size."""
    for index, (region, size) in enumerate(zip(regions, sizes, strict=False)):
        produced = 0
        for chunk in region():
            produced += chunk.numel() * chunk.element_size()
            box = [chunk]
            del chunk
            yield box.pop()  # this frame keeps no reference while suspended: a used-up chunk is freed at once
        if produced != size:
            raise AssertionError(f"region {index} produced {produced} of its {size} bytes")


class StreamWriter:
    """Writes consecutive stream bytes into ``targets`` in order: contiguous tensors (the bytes are theirs), or
    sinks that rebuild a region from other bytes (``nbytes`` and ``write(uint8 tensor)``, e.g. a quantized
    region dequantized on arrival, :class:`twinkle_strategy.quantized.wire.DecodingSink`)."""

    def __init__(self, targets: list):
        self._sinks = [_TensorSink(t) if isinstance(t, torch.Tensor) else t for t in targets]
        self._index, self._offset = 0, 0
        self.total = sum(sink.nbytes for sink in self._sinks)

    def write(self, chunk: torch.Tensor) -> int:
        used = 0
        while used < chunk.numel() and self._index < len(self._sinks):
            sink = self._sinks[self._index]
            take = min(chunk.numel() - used, sink.nbytes - self._offset)
            sink.write(chunk[used:used + take])
            used += take
            self._offset += take
            if self._offset == sink.nbytes:
                self._index, self._offset = self._index + 1, 0
        return used


class _TensorSink:
    """Stream bytes that are a tensor's own bytes, written in place."""

    def __init__(self, tensor: torch.Tensor):
        self._view = as_bytes_view(tensor)
        self.nbytes, self._offset = self._view.numel(), 0

    def write(self, data: torch.Tensor) -> None:
        self._view[self._offset:self._offset + data.numel()].copy_(data)
        self._offset += data.numel()


def as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 *view* (writes go to ``tensor``); the tensor must be contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("destination shard is not contiguous")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.view(-1).view(torch.uint8)
