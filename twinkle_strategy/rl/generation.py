"""``model.generate`` on a wrapped model, on every rank, and the routing record of what it generated.

Under FSDP2 and EP every forward is collective (parameter all-gathers, token all-to-alls), so every rank
must take every decoding step until the last rank's sequences end. transformers' ``synced_gpus`` does
that: a rank whose sequences ended keeps running forwards. transformers turns it on by itself when it
sees an FSDP-managed module; we pass it explicitly (a PEFT wrapper or another front module can hide it).

A rank with no prompt cannot call ``generate`` (a model forward of zero rows fails in its reshapes), yet
its peers wait for its collectives: it generates one token for a one-token dummy prompt, then takes the
synchronised steps, and returns zero sequences.

PEFT's ``generate`` calls its base model's, past the PEFT wrapper that FSDP2 made the root: the root's
parameters (embeddings, final norm, head) would stay sharded. So the root is unsharded for the whole call.
And FSDP2 settles which module is its root on the first forward: one that starts below the root (PEFT's
``generate`` before any training forward, as in GRPO's first step) would make every layer a root of its own,
and the root's first forward would then fail. So before a root has run forward, it runs one on a single token.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.rl.replay import RoutingHooks


def generate(model: nn.Module, hooks: RoutingHooks | None, *, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, return_routing: bool = False, **kwargs):
    """``model.generate(input_ids=..., attention_mask=..., **kwargs)`` on every rank, ``input_ids`` possibly empty.

    Returns what ``generate`` returns, or with ``return_routing`` ``(that, record)`` where ``record``
    [batch, length, MoE layers, top_k] holds the experts each generated sequence's tokens were routed to
    (:meth:`~twinkle_strategy.rl.replay.RoutingRecorder.generated`): the record R3 replays for a run that
    generates with its own policy.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        kwargs.setdefault("synced_gpus", True)
    empty = input_ids.shape[0] == 0
    ids, mask = input_ids, attention_mask
    if empty:
        pad = kwargs.get("pad_token_id", getattr(getattr(model, "generation_config", None), "pad_token_id", None))
        ids = torch.full((1, 1), pad if pad is not None else 0, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.ones_like(ids)
        kwargs = {**kwargs, "max_new_tokens": 1, "min_new_tokens": 0}
        kwargs.pop("max_length", None)
    if return_routing and hooks is None:
        raise ModelStructureError("generate(return_routing=True) needs a model whose routing can be recorded")
    recording = hooks.recording() if return_routing else contextlib.nullcontext()
    _settle_fsdp_root(model, ids[:1, :1])
    with recording as recorder, _root_unsharded(model):
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    if empty:
        sequences = input_ids.new_empty((0, input_ids.shape[1]))
        if isinstance(out, torch.Tensor):
            out = sequences
        else:
            out.sequences = sequences
            for name in ("scores", "logits"):
                if getattr(out, name, None) is not None:
                    setattr(out, name, tuple(step[:0] for step in getattr(out, name)))
    if not return_routing:
        return out
    return out, recorder.generated(sequences)


def _settle_fsdp_root(model: nn.Module, token: torch.Tensor) -> None:
    if not isinstance(model, FSDPModule) or getattr(model, "_twinkle_root_settled", False):
        return
    with torch.no_grad():
        model(input_ids=token, attention_mask=torch.ones_like(token))  # collective: every rank generates
    object.__setattr__(model, "_twinkle_root_settled", True)


@contextlib.contextmanager
def _root_unsharded(model: nn.Module):
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()  # collective, on every rank; the layers still unshard and reshard themselves per step
    try:
        yield
    finally:
        model.reshard()
