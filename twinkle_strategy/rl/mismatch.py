"""Trainer/rollout mismatch telemetry: how far the trainer's forward is from the engine that generated the rollouts.

* :func:`logprob_mismatch`: over completion tokens, the mean absolute difference between the rollout engine's
  logprobs and the trainer's, and the KL between the two policies by the k3 estimator (the tokens were sampled by the
  rollout policy q, so with ``log r = log p_trainer - log q``, ``k3 = exp(log r) - 1 - log r``: unbiased for
  KL(q || p_trainer), never negative).
* :func:`routing_disagreement`: the share of (token, MoE layer) routing decisions whose top-k expert sets differ
  between two records (the rollout's and the trainer's own), over the tokens both routed.

Both sum over the ranks when ``reduce`` (collective: every rank calls, even with no token).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.rl.record import NOT_RECORDED


@dataclasses.dataclass(frozen=True)
class LogprobMismatch:
    mean_abs: float  # mean |trainer logprob - rollout logprob| over the compared tokens
    kl_k3: float  # mean k3 estimate of KL(rollout || trainer)
    tokens: int  # the tokens compared (over every rank when reduced)


def _summed(values: list[torch.Tensor], *, reduce: bool) -> torch.Tensor:
    sums = torch.stack([v.detach().to(torch.float64).cpu() for v in values])
    if reduce and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        sums = sums.to(device)
        dist.all_reduce(sums)
    return sums.cpu()


def logprob_mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *,
                     mask: torch.Tensor | None = None, reduce: bool = True) -> LogprobMismatch | None:
    """The mismatch over the tokens where ``mask`` (completion tokens; default all) is set, ``[batch, completion]``
    each; None when no token was compared (on any rank)."""
    if trainer_logprobs.shape != rollout_logprobs.shape:
        raise ArgumentError(f"logprob_mismatch: trainer logprobs {list(trainer_logprobs.shape)} and rollout logprobs "
                         f"{list(rollout_logprobs.shape)} must have the same shape [batch, completion tokens]")
    mask = torch.ones_like(trainer_logprobs, dtype=torch.bool) if mask is None else mask.bool()
    log_ratio = (trainer_logprobs.detach().float() - rollout_logprobs.detach().float()).masked_fill(~mask, 0.0)
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    abs_sum, k3_sum, tokens = _summed([log_ratio.abs().sum(), k3.sum(), mask.sum()], reduce=reduce).tolist()
    if tokens == 0:
        return None
    return LogprobMismatch(mean_abs=abs_sum / tokens, kl_k3=k3_sum / tokens, tokens=int(tokens))


def routing_disagreement(reference: torch.Tensor, routed: torch.Tensor, *, mask: torch.Tensor | None = None,
                         reduce: bool = True) -> float | None:
    """The share of (token, layer) decisions where ``routed``'s expert set differs from ``reference``'s (records
    ``[..., layers, top_k]`` alike), over the tokens where ``mask`` (``[...]``) is set and both have a record."""
    if reference.shape != routed.shape:
        raise ArgumentError(f"routing_disagreement: records of shapes {list(reference.shape)} and {list(routed.shape)}")
    compared = (reference != NOT_RECORDED).all(-1) & (routed != NOT_RECORDED).all(-1)  # [..., layers]
    if mask is not None:
        compared &= mask.bool()[..., None]
    differ = (reference.sort(-1).values != routed.sort(-1).values).any(-1) & compared
    differing, decisions = _summed([differ.sum(), compared.sum()], reduce=reduce).tolist()
    return None if decisions == 0 else differing / decisions
