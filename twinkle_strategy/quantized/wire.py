"""Regions of a quantized release sent as stored (quantized bytes and scales), rebuilt on the receiving rank.

A rank's region of a model tensor made from FP8 weights is about half its
bf16 bytes as stored (FP4: a quarter): so the source sends what it read, and
the receiving rank dequantizes on its own device and applies transformers'
conversion rule (merging experts, concatenating gate and up ...) itself.

A :class:`WireForm` is the whole agreement between the two sides: which
checkpoint pieces (key, rows, :class:`~twinkle_strategy.quantized.codec.Codec`)
make each chunk of rows of the region, and the rule that combines them. It is
planned on the source from the headers (no read) and sent to the receiver
before any weight moves. Chunks are cut at scale-block boundaries, so no scale
row travels twice.

Key layouts are not known here: the source's
:class:`~twinkle_strategy.checkpoint.layout.CheckpointLayout` says which rule
makes a tensor and how its rows map (``recipes``, ``row_writable``), and the
form carries that rule as the layout's picklable ``Conversion``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch

from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.quantized.codec import Codec
from twinkle_strategy.quantized.formats import QuantizedIndex


@dataclasses.dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's rows as sent: quantized parts (``codec``) or plain values (``plain``)."""

    pattern: str  # the rule's source pattern it is collected under
    key: str
    rows: tuple[int, int] | None  # rows of the checkpoint tensor; None: all of it (a whole expert)
    codec: Codec | None
    plain: TensorSpec | None = None

    @property
    def nbytes(self) -> int:
        if self.codec is not None:
            return self.codec.nbytes
        return self.plain.nbytes

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The piece's values in the model's dtype (cast at once, as from_pretrained does)."""
        if self.codec is not None:
            return self.codec.decode(self.codec.split(data)).to(dtype)
        return data.view(self.plain.dtype).reshape(self.plain.shape).to(dtype)


@dataclasses.dataclass(frozen=True)
class WireChunk:
    rows: tuple[int, int]  # rows of the region this chunk fills
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)


@dataclasses.dataclass(frozen=True)
class WireForm:
    """How a region travels as stored, and how the receiver rebuilds it (picklable, no file needed)."""

    name: str  # the model tensor
    dtype: torch.dtype  # the model's dtype
    convert: Callable  # the transformers rule: pieces -> model tensors (the layout's Conversion)
    chunks: tuple[WireChunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def decode(self, chunk: WireChunk, data: torch.Tensor, config) -> torch.Tensor:
        """Rows ``chunk.rows`` of the region, from the chunk's bytes ``data`` (uint8, on any device)."""
        pieces: dict[str, list] = {}
        at = 0
        for piece in chunk.pieces:
            values = piece.decode(data[at:at + piece.nbytes], self.dtype)
            pieces.setdefault(piece.pattern, []).append((piece.key, values))
            at += piece.nbytes
        rows = chunk.rows[1] - chunk.rows[0]
        out = self.convert(pieces, config=config, rows=rows)[self.name]
        return out.to(self.dtype)


def plan_wire_form(layout, name: str, runs: list[tuple[int, int]], *, chunk_bytes: int) -> WireForm | None:
    """The region made of rows ``runs`` of model tensor ``name`` (runs ``[a, b)``, in order: one for most
    regions, two for LongCat's experts and zero slots) as stored, if that is fewer bytes than its values;
    else None."""
    index = layout.index
    recipe = layout.recipes[name]
    shape, dtype = recipe.targets[name]
    if not isinstance(index, QuantizedIndex) or not layout.row_writable(name):
        return None
    total = sum(b - a for a, b in runs)
    if not any(index.tensors[k].quantized for k in recipe.checkpoint_keys) or not total:
        return None
    chunks, offset = [], 0
    for a, b in runs:
        chunks += [WireChunk((offset + lo - a, offset + hi - a), _pieces(index, recipe, (lo, hi)))
                   for lo, hi in _chunk_bounds(index, recipe, (a, b), chunk_bytes)]
        offset += b - a
    form = WireForm(name, dtype, recipe.conversion(), tuple(chunks))
    values = total * math.prod(shape[1:]) * dtype.itemsize
    return form if form.nbytes < values else None


def _pieces(index: QuantizedIndex, recipe, rows: tuple[int, int]) -> tuple[Piece, ...]:
    """The checkpoint pieces of rows ``[a, b)``: rows of each source (renamed, row-wise rules) or whole
    per-expert tensors (experts ``a..b-1``)."""
    out = []
    for pattern, keys in recipe.sources.items():
        if recipe.per_expert:
            out += [_piece(index, pattern, key, None) for key in keys[rows[0]:rows[1]]]
        else:
            out += [_piece(index, pattern, key, rows) for key in keys]
    return tuple(out)


def _piece(index: QuantizedIndex, pattern: str, key: str, rows) -> Piece:
    codec = index.codec(key, rows)
    if codec is not None:
        return Piece(pattern, key, rows, codec)
    stored = index.tensors[key]
    shape = stored.shape if rows is None else (rows[1] - rows[0],) + tuple(stored.shape[1:])
    return Piece(pattern, key, rows, None, TensorSpec(tuple(shape), stored.dtype))


def _chunk_bounds(index: QuantizedIndex, recipe, rows: tuple[int, int], chunk_bytes: int) -> list[tuple[int, int]]:
    """Rows ``[a, b)`` cut into runs of about ``chunk_bytes`` as stored. The cuts fall on multiples of the
    scale block, so no scale row travels twice."""
    align = _rows_per_scale_row(index, recipe)
    step = max(chunk_bytes // _bytes_per_row(index, recipe) // align, 1) * align
    first_cut = (rows[0] // align + 1) * align + step - align
    edges = [rows[0], *range(first_cut, rows[1], step), rows[1]]
    return list(zip(edges[:-1], edges[1:], strict=False))


def _rows_per_scale_row(index: QuantizedIndex, recipe) -> int:
    if recipe.per_expert:  # a row is an expert, whose tensors travel whole with all their scales
        return 1
    return max((index.tensors[k].block[0] for k in recipe.checkpoint_keys if index.tensors[k].quantized), default=1)


def _bytes_per_row(index: QuantizedIndex, recipe) -> int:
    """About what one row of the region is as stored (one expert's tensors; a row and a scale row)."""
    if recipe.per_expert:
        return max(sum(_piece(index, p, keys[0], None).nbytes for p, keys in recipe.sources.items()), 1)
    return max(sum(_piece(index, p, k, (0, 1)).nbytes for p, keys in recipe.sources.items() for k in keys), 1)


def read_chunks(layout, form: WireForm) -> Iterator[torch.Tensor]:
    """The source's side: each chunk's pieces as read from the checkpoint (quantized bytes, scales), in order."""
    index = layout.index
    for chunk in form.chunks:
        for piece in chunk.pieces:
            if piece.codec is not None:
                yield from index.read_parts(piece.key, piece.rows)[1]
            else:
                yield index.read(piece.key, piece.rows)


class DecodingSink:
    """The receiver's side: takes a region's stream bytes in order and fills its rows of ``local``, a chunk
    at a time (one chunk's bytes staged at once)."""

    def __init__(self, local: torch.Tensor, form: WireForm, config):
        self.local, self.form, self.config = local, form, config
        self.nbytes = form.nbytes
        self._chunk, self._staged, self._filled = 0, None, 0

    def write(self, data: torch.Tensor) -> None:
        """Append ``data`` (uint8) to the region's stream; decodes every chunk it completes."""
        used = 0
        while used < data.numel():
            chunk = self.form.chunks[self._chunk]
            if self._staged is None:
                self._staged = torch.empty(chunk.nbytes, dtype=torch.uint8, device=data.device)
            take = min(data.numel() - used, chunk.nbytes - self._filled)
            self._staged[self._filled:self._filled + take].copy_(data[used:used + take])
            used, self._filled = used + take, self._filled + take
            if self._filled == chunk.nbytes:
                self._finish(chunk)

    def _finish(self, chunk: WireChunk) -> None:
        values = self.form.decode(chunk, self._staged, self.config)
        with torch.no_grad():  # (the slice too: a view of a parameter's local tensor made with grad is read-only)
            target = self.local[chunk.rows[0]:chunk.rows[1]]
            target.copy_(values.reshape(target.shape))
        self._chunk, self._staged, self._filled = self._chunk + 1, None, 0
