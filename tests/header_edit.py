"""Safetensors files with a hand-edited header and the same tensor bytes: the corruptions safetensors rejects."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def read_header(file: Path) -> tuple[dict, bytes]:
    raw = Path(file).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_with_header(file: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(file).write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def overlap(header: dict) -> str:
    """The second of two neighbouring tensors of equal size gets the first one's bytes; returns its key."""
    keys = _by_offset(header)
    size = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in keys}
    first, second = next((a, b) for a, b in zip(keys, keys[1:], strict=False) if size[a] == size[b] > 0)
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    return second


def reverse_offsets(header: dict) -> str:
    key = next(k for k in _by_offset(header) if header[k]["data_offsets"][1] > header[k]["data_offsets"][0])
    header[key]["data_offsets"].reverse()
    return key


def unknown_dtype(header: dict) -> str:
    key = _by_offset(header)[0]
    header[key]["dtype"] = "F33"
    return key


def wrong_shape_for_bytes(header: dict) -> str:
    key = next(k for k in _by_offset(header) if header[k]["shape"])
    header[key]["shape"][0] += 1
    return key


EDITS = {"overlapping_offsets": overlap, "reversed_offsets": reverse_offsets, "unknown_dtype": unknown_dtype,
         "shape_not_matching_bytes": wrong_shape_for_bytes}


def corrupt_copy(file: Path, target: Path, edit: str) -> str:
    """``file`` rewritten to ``target`` with the header edit named ``edit``; returns the edited tensor's key."""
    header, data = read_header(file)
    key = EDITS[edit](header)
    write_with_header(target, header, data)
    return key
