"""Activation checkpointing that neither routes nor communicates again when it recomputes.

``torch.utils.checkpoint`` (non-reentrant) recomputes a decoder layer's forward
during the backward. With expert parallelism that forward holds two
all-to-alls per MoE layer (tokens out to the experts' owners, results back),
and a count exchange that synchronises with the host. Recomputing them would
double the step's communication, and a recomputed router could, in low
precision, route a token differently from the forward that the loss saw.

So each checkpointed forward keeps a :class:`ForwardRecord`: the EP dispatch
appends what it received (split sizes, dispatched rows, returned rows, routing
decisions) in call order, and the recomputation replays them in the same order
instead of communicating, as torchtitan's selective checkpointing saves the
all-to-all outputs. The two halves are ``torch.utils.checkpoint``'s public
``context_fn``: :func:`checkpoint_contexts` returns a recording context (the
original forward) and a replaying one (the recomputation), sharing one record.

The same mechanism serves transformers' own ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` before 5.23; its kwargs become ``{"use_reentrant": False,
"context_fn": checkpoint_contexts}``), which is how the swift plugin uses it, and
:func:`apply_activation_checkpointing`, which the trainer uses: it makes each decoder layer a
:class:`CheckpointedLayer`, the same instance with its class swapped (:mod:`.class_swap`), because
torch's ``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every parameter name.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from twinkle_strategy.compat.transformers_internals import wrap_checkpointing_enable, wrap_checkpointing_function
from twinkle_strategy.moe.class_swap import swap_class

_ACTIVE: contextvars.ContextVar[ForwardRecord | None] = contextvars.ContextVar("twinkle_forward_record",
                                                                                 default=None)
# Context the recomputation must see as its forward saw it, although the backward runs later, outside the
# ``with`` blocks of the forward (routing replay: the recomputed routers must take the replayed experts).
_CARRIED: list[contextvars.ContextVar] = []


def carry_into_recomputation(var: contextvars.ContextVar) -> None:
    """Let the recomputation of every checkpointed forward see ``var`` (which needs a default) as that forward did."""
    if var not in _CARRIED:
        _CARRIED.append(var)


class ForwardRecord:
    """What the EP dispatch of one checkpointed forward produced, in call order."""

    def __init__(self) -> None:
        self.entries: collections.deque = collections.deque()
        self.replaying = False

    def keep(self, entry) -> None:
        self.entries.append(entry)

    def next(self):
        if not self.entries:
            raise RuntimeError("activation checkpointing: the recomputed forward dispatched to experts more often "
                               "than the original one; the layer's forward must be deterministic in its calls")
        return self.entries.popleft()


@contextlib.contextmanager
def _use(record: ForwardRecord, replaying: bool, carried: tuple = ()):
    record.replaying = replaying
    tokens = [(var, var.set(value)) for var, value in carried]
    token = _ACTIVE.set(record)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        for var, var_token in reversed(tokens):
            var.reset(var_token)


def checkpoint_contexts():
    """``context_fn`` for ``torch.utils.checkpoint``: (record the forward, replay it in the recomputation).

    Called when the checkpointed forward starts, so the carried context (:func:`carry_into_recomputation`)
    is read then and set again around the recomputation.
    """
    record = ForwardRecord()
    carried = tuple((var, var.get()) for var in _CARRIED)
    return _use(record, replaying=False), _use(record, replaying=True, carried=carried)


def active_record() -> ForwardRecord | None:
    """The record of the checkpointed forward running now (None outside activation checkpointing)."""
    return _ACTIVE.get()


def is_replaying() -> bool:
    """True while activation checkpointing recomputes a forward: nothing should be counted twice."""
    record = _ACTIVE.get()
    return record is not None and record.replaying


class CheckpointedLayer(nn.Module):
    """Mixin for a layer recomputed in the backward (non-reentrant), replaying its EP dispatch.

    Never instantiated: :func:`apply_activation_checkpointing` puts it in front of the layer's own class.
    FSDP2's hooks run around ``forward`` in ``__call__``, hence outside the recomputed region.
    """

    def forward(self, *args, **kwargs):
        own_forward = super().forward
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return own_forward(*args, **kwargs)
        kwargs = _without_kv_cache(kwargs)
        return checkpoint(own_forward, *args, use_reentrant=False, context_fn=checkpoint_contexts, **kwargs)

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return f"{own}, activation_checkpointing" if own else "activation_checkpointing"


def apply_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Recompute each of ``layers`` in the backward (non-reentrant), replaying its EP dispatch.

    Each layer becomes a :class:`CheckpointedLayer` and keeps its parameter names, so checkpoints,
    state dicts and FSDP2 (before or after) are unaffected. Idempotent.
    """
    for layer in layers:
        if not isinstance(layer, CheckpointedLayer):
            swap_class(layer, CheckpointedLayer)


def _without_kv_cache(kwargs: dict) -> dict:
    """``kwargs`` with every KV cache dropped and ``use_cache`` off.

    A cache would be appended to twice (forward and recomputation), as transformers' own
    checkpointing also knows; training does not need one. Caches are found by type, not by
    argument name: transformers renamed the layers' ``past_key_values`` to ``cache`` in 5.24,
    and a name list here then let the recomputation attend over twice the keys.
    """
    from transformers import Cache

    kwargs = {name: (None if isinstance(value, Cache) else value) for name, value in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def replay_in_transformers_checkpointing(model: nn.Module) -> None:
    """Make transformers' own activation checkpointing (``activation_checkpointing_enable``, used by
    ms-swift and the HF Trainer) non-reentrant with :func:`checkpoint_contexts`, whether it is
    enabled already or later."""
    for module in model.modules():
        wrap_checkpointing_function(module, _with_replay)
        wrap_checkpointing_enable(module, _enable_with_replay)


def _with_replay(func):
    keywords = dict(getattr(func, "keywords", None) or {})
    base = getattr(func, "func", checkpoint)  # transformers' own wrapper when it offloads to the host
    return functools.partial(base, **{**keywords, "use_reentrant": False, "context_fn": checkpoint_contexts})


def _enable_with_replay(enable):
    if getattr(enable, "_twinkle_replay", False):  # wrapped already
        return enable

    @functools.wraps(enable)
    def enable_with_replay(*args, **kwargs):
        # The options come by keyword (swift: gradient_checkpointing_kwargs=..., the name functools.wraps shows;
        # transformers 5.24: activation_checkpointing_kwargs=...) or first by position.
        key = next((k for k in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
                                "checkpointing_kwargs") if k in kwargs), None)
        given, args = (kwargs.pop(key), args) if key else (args[0] if args else None, args[1:])
        # The context_fn is added here, not in the user's kwargs: swift and HF serialise those into args.json.
        options = {**(given or {}), "use_reentrant": False, "context_fn": checkpoint_contexts}
        return enable(options, *args, **kwargs)

    enable_with_replay._twinkle_replay = True
    return enable_with_replay
