"""Throughput in the units people compare runs in: tokens/s, TFLOPS per device, MFU (for an MoE: active parameters).

FLOPs follow the usual training estimate (torchtitan, Megatron, PaLM's MFU):
``6 x active parameters`` per token for the forward and backward matmuls, plus
``12 x layers x attention width x sequence length`` for the attention scores.
Active parameters are those a token actually uses: every dense parameter
except the input embedding (a lookup, not a matmul), and of each MoE layer
only its ``top_k`` routed experts.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.discovery import find_moe_blocks

# Dense bf16 peak TFLOPS per device (vendor data sheets; no sparsity).
PEAK_TFLOPS = {
    "H100": 989.0,  # H100 SXM
    "H200": 989.0,
    "910B": 313.0,  # Ascend 910B (fp16/bf16)
}


def device_peak_tflops(device: torch.device) -> float | None:
    """The table's peak for this device's name, or None when unknown (CPU, other accelerators)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        name = torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    else:
        return None
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def _top_k(config) -> int:
    for key in ("num_experts_per_tok", "moe_topk", "top_k_experts"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return 1


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def active_parameters(model: nn.Module, *, ep_size: int = 1) -> int:
    """Parameters one token's forward uses (``ep_size``: the EP ``model`` is already cut by, else 1)."""
    try:
        blocks = find_moe_blocks(model)
    except ModelStructureError:  # experts we cannot identify (DBRX...): counted as dense, an upper bound
        blocks = []
    top_k = _top_k(_text_config(model))
    skip = {id(p) for p in model.get_input_embeddings().parameters()}
    active = 0
    for block in blocks:
        tensors = [getattr(t.module, t.attr) for t in block.tensors]
        skip.update(id(t) for t in tensors)
        # DTensor.numel() is the whole tensor: all of this rank's EP slice (the local experts).
        per_expert = sum(t.numel() for t in tensors) / block.num_experts
        active += int(per_expert * min(top_k, block.num_experts * ep_size))
    return active + sum(p.numel() for p in model.parameters() if id(p) not in skip)


@dataclasses.dataclass(frozen=True)
class FlopsModel:
    active_params: int
    num_layers: int
    attention_width: int  # heads x head dim

    @classmethod
    def of(cls, model: nn.Module, *, ep_size: int = 1) -> FlopsModel:
        config = _text_config(model)
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // max(heads, 1))
        return cls(active_parameters(model, ep_size=ep_size), int(config.num_hidden_layers), int(heads * head_dim))

    def per_token(self, seq_len: float) -> float:
        return 6.0 * self.active_params + 12.0 * self.num_layers * self.attention_width * seq_len


def throughput(flops: FlopsModel, *, tokens: float, seq_len: float, seconds: float, world_size: int,
               peak_tflops: float | None) -> dict[str, float]:
    """logging.jsonl's throughput fields for ``tokens`` global non-padding tokens trained in ``seconds``."""
    seconds = max(seconds, 1e-9)
    tflops = flops.per_token(seq_len) * tokens / seconds / world_size / 1e12
    result = {"tokens_per_second": round(tokens / seconds, 3), "tflops_per_device": round(tflops, 6)}
    if peak_tflops:
        result["mfu"] = round(tflops / peak_tflops, 6)
    return result
