"""A rank's chunk of a batch under Ulysses: every rank of a sequence-parallel group gets the same batch
and keeps the contiguous chunk ``rank`` of ``size`` of every row.

What one process would compute on the whole rows is kept:

* position ids are the whole row's (given ones, e.g. restarting at each packed example, or 0..S-1), so
  RoPE and the packed-sequence mask see global positions;
* labels are shifted on the whole row first (``shift_labels``, which transformers' causal-LM loss takes),
  because the label of a chunk's last token is the next chunk's first token;
* rows are padded on the right to a multiple of ``size`` (labels -100, attention mask 0): causal
  attention never lets a real token see the padding after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkle_strategy.errors import ParallelConfigError

# A routing record's batch key and padding (twinkle_strategy.rl.record; sequence/ sits below rl/).
ROUTED_EXPERTS = "routed_experts"
NOT_RECORDED = -1

IGNORE_INDEX = -100


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of ``batch`` a causal LM's loss is taken over: its ``shift_labels`` that are not -100 (a chunk of
    :func:`split_batch`, shifted on the whole row), else its ``labels`` after the first position (the model shifts
    them: the first label of a row is never predicted)."""
    return int(loss_token_count(batch))


def loss_token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`loss_tokens` as an int64 scalar on the labels' device, read by nobody: a step counts its tokens
    without waiting for the device (the count goes into a collective and the loss, never to the host)."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def split_batch(batch: dict[str, torch.Tensor], *, rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's chunk of ``batch`` (``input_ids``, ``labels``, optional ``attention_mask``/``position_ids``, and a
    routing record ``routed_experts`` [rows, length, layers, top_k], cut like ``input_ids``).

    The result has ``labels`` and ``shift_labels`` (both the shifted labels of the chunk: the model needs
    ``labels`` to compute a loss, and transformers' loss uses ``shift_labels`` as they are).
    """
    if "input_ids" not in batch or "labels" not in batch:
        raise ParallelConfigError(f"sequence parallelism splits a batch with input_ids and labels; this one has "
                                  f"{sorted(batch)}")
    rows, length = batch["input_ids"].shape
    padded = -(-length // size) * size
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=batch["input_ids"].device).expand(rows, -1)
    whole = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch.get("attention_mask", torch.ones_like(batch["input_ids"])),
        "position_ids": positions.expand(rows, -1),
        "labels": F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX),
    }
    pads = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}
    chunk = padded // size
    out = {}
    for name, tensor in whole.items():
        if padded > length:
            if name == "position_ids":  # padding continues the last positions, as a longer row would
                tail = tensor[:, -1:] + torch.arange(1, padded - length + 1, device=tensor.device)
                tensor = torch.cat([tensor, tail], dim=1)
            else:
                tensor = F.pad(tensor, (0, padded - length), value=pads[name])
        out[name] = tensor[:, rank * chunk:(rank + 1) * chunk].contiguous()
    out["shift_labels"] = out["labels"]
    if ROUTED_EXPERTS in batch:  # [rows, length, layers, top_k]: cut along the tokens, padding not recorded
        record = batch[ROUTED_EXPERTS]
        if padded > length:
            record = torch.cat([record, record.new_full((rows, padded - length, *record.shape[2:]), NOT_RECORDED)], 1)
        out[ROUTED_EXPERTS] = record[:, rank * chunk:(rank + 1) * chunk].contiguous()
    return out
