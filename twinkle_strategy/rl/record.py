"""The routing record: for each token and MoE layer, the ids of the experts it was routed to.

Layout: vLLM's and SGLang's ``routed_experts`` (vLLM ``enable_return_routed_experts``, SGLang
``return_routed_experts``), ``[tokens, layers, top_k]`` integers for one sequence, prompt and response,
with one column per MoE layer in model order (dense layers have none). A batch's record puts the token
axes of its ``input_ids`` in front: ``[batch, seq, layers, top_k]`` for ``input_ids`` ``[batch, seq]``.

:data:`NOT_RECORDED` (-1) marks tokens without a record (padding, or tokens the engine did not route):
replay lets the router choose for them. So a record survives:

* padding: :func:`pad_records` pads with -1 on the tokenizer's side;
* packing: :func:`pack_records` concatenates the examples' records as their tokens are concatenated;
* sequence parallelism: ``split_batch`` cuts ``routed_experts`` as it cuts ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle_strategy.errors import ArgumentError

# The batch key front-ends pass a record under (the name vLLM and SGLang give it), and the id of no record.
from twinkle_strategy.sequence.batch import NOT_RECORDED, ROUTED_EXPERTS

__all__ = ["NOT_RECORDED", "ROUTED_EXPERTS", "pack_records", "pad_records", "record_problem"]


def pad_records(records: Sequence[torch.Tensor], *, length: int | None = None,
                padding_side: str = "right") -> torch.Tensor:
    """``[batch, length, layers, top_k]`` from each sequence's ``[tokens, layers, top_k]``, padded with -1 on
    ``padding_side`` (the tokenizer's), as their ``input_ids`` are padded."""
    if padding_side not in ("left", "right"):
        raise ArgumentError(f"padding_side is 'left' or 'right', not {padding_side!r}")
    longest = max(r.shape[0] for r in records)
    length = longest if length is None else length
    if length < longest:
        raise ArgumentError(f"pad_records: length={length} is shorter than the longest record ({longest} tokens)")
    layers, top_k = records[0].shape[1:]
    out = torch.full((len(records), length, layers, top_k), NOT_RECORDED, dtype=torch.long)
    for row, record in enumerate(records):
        tokens = record.shape[0]
        where = slice(0, tokens) if padding_side == "right" else slice(length - tokens, length)
        out[row, where] = record.to(torch.long)
    return out


def pack_records(records: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[1, total, layers, top_k]``: the records of examples packed into one row, in the order of their tokens."""
    return torch.cat([r.to(torch.long) for r in records]).unsqueeze(0)


def record_problem(record: torch.Tensor, input_ids: torch.Tensor, *, num_layers: int, top_k: int,
                   num_experts: int) -> str | None:
    """Why ``record`` cannot be replayed on a forward of ``input_ids`` (one line), or None."""
    expected = (*input_ids.shape, num_layers, top_k)
    if not isinstance(record, torch.Tensor) or record.is_floating_point() or record.is_complex():
        kind = record.dtype if isinstance(record, torch.Tensor) else type(record).__name__
        return f"routed_experts must be an integer tensor [tokens, layers, top_k], got {kind}"
    if tuple(record.shape) != expected:
        return (f"routed_experts has shape {list(record.shape)} but input_ids {list(input_ids.shape)} on a model "
                f"with {num_layers} MoE layers and top_k={top_k} needs {list(expected)} (one entry per token, MoE "
                "layer and choice; -1 for tokens without a record)")
    low, high = int(record.min()) if record.numel() else 0, int(record.max()) if record.numel() else 0
    if low < NOT_RECORDED or high >= num_experts:
        return (f"routed_experts holds expert ids from {low} to {high}, outside 0..{num_experts - 1} "
                "(-1 marks tokens without a record)")
    return None
