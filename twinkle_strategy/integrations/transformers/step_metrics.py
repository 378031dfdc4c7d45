"""What HF's log lines gain under the strategy: ``tokens_per_second``, ``moe_load_imbalance`` and ``mfu``.

Tokens are the non-padding tokens of every rank (the attention mask), counted between two log
lines; the expert load is the router's real choices over the global batch (:mod:`twinkle_strategy.moe.load`);
MFU is the usual ``6 x active parameters`` estimate against the device's known peak, absent where the
peak is unknown (CPU).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.discovery import find_moe_blocks
from twinkle_strategy.moe.flops import FlopsModel, device_peak_tflops, throughput
from twinkle_strategy.moe.load import ExpertLoad, load_imbalance

logger = logging.getLogger(__name__)


class StepMetrics:
    """Counts tokens and expert load between two HF log lines (``observe`` each training micro-batch)."""

    def __init__(self, model: nn.Module, *, ep_size: int, device: torch.device) -> None:
        self.device = device
        self.expert_load = _expert_load_or_none(model, ep_size=ep_size)
        self.flops = FlopsModel.of(model, ep_size=ep_size) if self.expert_load is not None else None
        self.peak_tflops = device_peak_tflops(device)
        self.tokens = 0
        self.sequences = 0
        self.since = time.perf_counter()

    def observe(self, inputs: dict) -> None:
        """Before a training forward: count its tokens, and keep padding out of the expert load."""
        mask = inputs.get("attention_mask")
        ids = inputs.get("input_ids")
        if self.expert_load is not None:
            self.expert_load.token_mask = mask
        if mask is not None:
            self.tokens += int(mask.sum())
            self.sequences += mask.shape[0]
        elif ids is not None:
            self.tokens += ids.numel()
            positions = inputs.get("position_ids")
            # A packed row holds one sequence per restart of its positions (the attention FLOPs' length).
            self.sequences += int((positions == 0).sum()) if positions is not None else ids.shape[0]

    def mask_tokens(self, mask) -> None:
        """Before a forward of another shape than the observed batch (a sequence-parallel chunk): its padding mask."""
        if self.expert_load is not None:
            self.expert_load.token_mask = mask

    def take(self) -> dict[str, float]:
        """The fields since the last call, over every rank (collective); resets."""
        totals = torch.tensor([self.tokens, self.sequences], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(totals)
        tokens, sequences = totals.tolist()
        seconds = time.perf_counter() - self.since
        fields: dict[str, float] = {}
        if self.flops is not None and sequences:
            world = dist.get_world_size() if dist.is_initialized() else 1
            fields.update(throughput(self.flops, tokens=tokens, seq_len=tokens / sequences, seconds=seconds,
                                     world_size=world, peak_tflops=self.peak_tflops))
        else:
            fields["tokens_per_second"] = round(tokens / max(seconds, 1e-9), 3)
        if self.expert_load is not None:
            counts = self.expert_load.take_global()
            if counts.sum() > 0:
                fields["moe_load_imbalance"] = round(load_imbalance(counts), 6)
        self.tokens = self.sequences = 0
        self.since = time.perf_counter()
        return fields


def _expert_load_or_none(model: nn.Module, *, ep_size: int) -> ExpertLoad | None:
    try:
        return ExpertLoad(model, ep_size=ep_size) if find_moe_blocks(model) else None
    except ModelStructureError as exc:
        logger.warning("no expert-load statistics: %s", exc)
        return None
