"""Routing replay (R2, R3) and routing records, at the routers of an MoE model.

Each MoE layer's router gets a forward hook (``register_forward_hook``, prepended: it runs on the
router's output before any other post-forward hook, FSDP2's included, as code at the end of the
router's ``forward`` would) that, inside :meth:`RoutingHooks.replaying`, swaps the router's choice for
the record's and recomputes the combine weights from the router's logits at those ids (:mod:`.routers`), so

* the block dispatches the recorded experts: the EP all-to-all, the expert-load counts and LoRA on the
  experts all see them, as they see any routing;
* the router still gets a gradient, through the weights;
* activation checkpointing's recomputation replays the same ids: the replay context is carried into it
  (:func:`~twinkle_strategy.moe.recompute.carry_into_recomputation`), even when the backward runs after
  the ``with`` block, and EP's recomputation check (the recomputed router chose the forward's experts)
  then holds.

Inside :meth:`RoutingHooks.recording` the routers' choices are kept instead: the trainer's own record
(R2: the old-policy forward records, the update forwards of the same batch replay it).

Telemetry: while replaying, each layer counts the tokens whose recorded top-k set equals the one the
router would have chosen (:meth:`RoutingHooks.take_agreement`), so a drifting rollout engine shows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn

from twinkle_strategy.errors import ArgumentError, CallOrderError, ModelStructureError
from twinkle_strategy.moe.discovery import find_moe_blocks, model_family
from twinkle_strategy.moe.recompute import carry_into_recomputation, is_replaying
from twinkle_strategy.rl.record import NOT_RECORDED, record_problem
from twinkle_strategy.rl.routers import RouterRule, find_router, rule_for


@dataclasses.dataclass
class _Routing:
    """What the routers do in the current context: replay ``replay`` [rows, layers, k], record into ``recorded``."""

    hooks: RoutingHooks
    replay: torch.Tensor | None = None
    recorded: list[list[torch.Tensor]] | None = None
    # While replaying: the experts each layer used in its latest forward (the global-batch aux loss counts them).
    used: list[torch.Tensor | None] = dataclasses.field(default_factory=list)


_CURRENT: contextvars.ContextVar[_Routing | None] = contextvars.ContextVar("twinkle_routing", default=None)
carry_into_recomputation(_CURRENT)


@dataclasses.dataclass(frozen=True)
class RoutedLayer:
    name: str  # the router's fully qualified name
    router: nn.Module


class RoutingRecorder:
    """The routers' choices during :meth:`RoutingHooks.recording`, in call order per layer."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.top_k = top_k
        self.per_layer: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def routed_experts(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, layers, top_k]`` (rows of every forward recorded, in order), or with ``like`` (the
        forward's ``input_ids``) ``[*like.shape, layers, top_k]``."""
        if any(not calls for calls in self.per_layer):
            raise CallOrderError("routing record: no forward ran inside strategy.routing_record()")
        record = torch.stack([torch.cat(calls) for calls in self.per_layer], dim=1)
        return record if like is None else record.reshape(*like.shape, *record.shape[1:])

    def generated(self, sequences: torch.Tensor) -> torch.Tensor:
        """The record of ``model.generate`` (KV cache on) that returned ``sequences`` [batch, length]:
        ``[batch, length, layers, top_k]``, aligned with ``sequences`` (prompt padding included).

        ``generate`` feeds the prompts once, then one token per sequence per step; the last token is never fed
        (-1). Steps a rank keeps taking after its own sequences ended (``synced_gpus``) are dropped.
        """
        batch, length = sequences.shape
        if batch == 0:
            return torch.full((0, length, len(self.per_layer), self.top_k), NOT_RECORDED, dtype=torch.long)
        if any(not calls for calls in self.per_layer):
            raise CallOrderError("routing record: no forward ran inside strategy.routing_record()")
        per_layer = [torch.cat([call.view(batch, -1, call.shape[-1]) for call in calls], dim=1)
                     for calls in self.per_layer]
        fed = torch.stack(per_layer, dim=2)[:, :length - 1]
        last = fed.new_full((batch, length - fed.shape[1], *fed.shape[2:]), NOT_RECORDED)
        return torch.cat([fed, last], dim=1)


class RoutingHooks:
    """The routers of ``model``, hooked so routing can be replayed and recorded.

    A model whose routers replay cannot force (no rule for their class: hash routing, Llama-4's
    pre-routed scores ...) gets no hook; :attr:`refusal` says why, and replaying or recording raises it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.family = model_family(model)
        self.layers: list[RoutedLayer] = []
        self.refusal: str | None = None
        try:
            blocks = find_moe_blocks(model)
        except ModelStructureError as exc:  # experts no dispatch serves: neither can replay
            self.refusal = f"routing replay does not serve {self.family}: {exc}"
            return
        if not blocks:
            self.refusal = f"{self.family} has no MoE block: there is no routing to replay"
            return
        names = {module: name for name, module in model.named_modules()}
        for block in blocks:
            router = find_router(block.block)
            if router is None or rule_for(router) is None:
                what = "has no router module" if router is None else f"routes with {type(router).__name__}"
                self.refusal = (f"routing replay does not serve {self.family}: {block.name or 'the model'} {what}, "
                                "which cannot take forced expert ids (served: the softmax top-k routers of "
                                "Qwen-MoE/Mixtral, the sigmoid group-limited routers of DeepSeek-V3/GLM, gpt-oss)")
                return
            self.layers.append(RoutedLayer(names[router], router))
        top_ks = {int(layer.router.top_k) for layer in self.layers}
        if len(top_ks) != 1:
            self.refusal = f"routing replay: {self.family}'s MoE layers choose different numbers of experts {top_ks}"
            return
        self.top_k = top_ks.pop()
        self.num_experts = max(int(layer.router.num_experts) for layer in self.layers)
        self._agree: torch.Tensor | None = None  # [layers, 2]: tokens whose sets agree, tokens compared
        for index, layer in enumerate(self.layers):
            layer.router.register_forward_hook(functools.partial(self._route, index, rule_for(layer.router)),
                                               prepend=True)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_served(self) -> None:
        if self.refusal is not None:
            raise ModelStructureError(self.refusal)

    @contextlib.contextmanager
    def replaying(self, record: torch.Tensor, *, input_ids: torch.Tensor):
        """Forwards of ``input_ids`` inside dispatch the experts of ``record`` ``[*input_ids.shape, layers, top_k]``
        (-1: the router chooses). Checks on this rank only; see :meth:`record_problem` for a collective check.
        Yields the replay's state: ``.used[layer]``, the experts each layer used in its latest forward."""
        self.check_served()
        problem = self.record_problem(record, input_ids)
        if problem is not None:
            raise ArgumentError(problem)
        rows = record.reshape(-1, self.num_layers, self.top_k).to(device=input_ids.device, dtype=torch.long)
        state = dataclasses.replace(self._current(), replay=rows, used=[None] * self.num_layers)
        token = _CURRENT.set(state)
        try:
            yield state
        finally:
            _CURRENT.reset(token)

    def record_problem(self, record: torch.Tensor, input_ids: torch.Tensor) -> str | None:
        return record_problem(record, input_ids, num_layers=self.num_layers, top_k=self.top_k,
                              num_experts=self.num_experts)

    @contextlib.contextmanager
    def recording(self):
        """Forwards inside keep their routers' choices; yields the :class:`RoutingRecorder`."""
        self.check_served()
        recorder = RoutingRecorder(self.num_layers, self.top_k)
        token = _CURRENT.set(dataclasses.replace(self._current(), recorded=recorder.per_layer))
        try:
            yield recorder
        finally:
            _CURRENT.reset(token)

    def _current(self) -> _Routing:
        """The routing context to extend (replaying and recording nest: a replay is recorded as replayed)."""
        current = _CURRENT.get()
        return current if current is not None and current.hooks is self else _Routing(self)

    @contextlib.contextmanager
    def uncounted(self):
        """Replays inside stay out of :meth:`take_agreement` (scoring forwards: the reference policy routes otherwise
        by design, and the telemetry is of the forwards that train)."""
        saved, self._agree = self._agree, None
        try:
            yield
        finally:
            self._agree = saved

    def take_agreement(self, *, reduce: bool = True) -> list[float] | None:
        """Per MoE layer, the share of replayed tokens whose recorded top-k set equals the router's own choice,
        since the last call (summed over ranks when ``reduce``: collective); None if nothing was replayed."""
        return agreement_shares(self.take_agreement_counts(reduce=reduce))

    def take_agreement_counts(self, *, reduce: bool = True) -> torch.Tensor:
        """:meth:`take_agreement`'s [layers, (agreeing, replayed)] token counts, left on the device (a training
        step takes them without a host sync; :func:`agreement_shares` reads them at the log line)."""
        self.check_served()
        device = self.layers[0].router.weight.device
        counts = self._agree if self._agree is not None else torch.zeros(self.num_layers, 2, device=device)
        self._agree = None
        if reduce and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        return counts

    def _route(self, index: int, rule: RouterRule, router: nn.Module, args: tuple, output: tuple) -> tuple:
        """The router's output ``(logits, weights, ids)``, with the replayed ids and their weights, recorded."""
        logits, weights, ids = output
        state = _CURRENT.get()
        if state is None or state.hooks is not self:
            return output
        if state.replay is not None:
            forced = state.replay[:, index]
            if forced.shape[0] != ids.shape[0]:
                raise ArgumentError(f"routing replay: {self.layers[index].name} routes {ids.shape[0]} tokens but the "
                                 f"record has {forced.shape[0]}; replay a record inside the forward of its batch")
            recorded = (forced != NOT_RECORDED).all(dim=-1, keepdim=True)
            ids_own = ids
            ids = torch.where(recorded, forced, ids)
            if not is_replaying():  # the recomputation of activation checkpointing would count twice
                self._count_agreement(index, forced, ids_own, recorded)
                state.used[index] = ids.detach()
            weights = torch.where(recorded, rule.weights(router, logits, ids, like=weights), weights)
        if state.recorded is not None and not is_replaying():
            state.recorded[index].append(ids.detach().clone())
        return logits, weights, ids

    @torch.no_grad()
    def _count_agreement(self, index: int, forced: torch.Tensor, ids: torch.Tensor, recorded: torch.Tensor) -> None:
        same = (forced.sort(dim=-1).values == ids.sort(dim=-1).values).all(dim=-1) & recorded.squeeze(-1)
        if self._agree is None:
            self._agree = torch.zeros(self.num_layers, 2, device=ids.device)
        self._agree[index] += torch.stack([same.sum(), recorded.sum()]).to(self._agree.dtype)  # no host sync


def routing_hooks(model: nn.Module) -> RoutingHooks:
    """The model's :class:`RoutingHooks`, created on first use (the routers are hooked once)."""
    hooks = getattr(model, "_twinkle_routing_hooks", None)
    if hooks is None:
        hooks = RoutingHooks(model)
        object.__setattr__(model, "_twinkle_routing_hooks", hooks)  # not a submodule, not a parameter
    return hooks


def agreement_shares(counts: torch.Tensor) -> list[float] | None:
    """Per MoE layer, agreeing / replayed tokens of :meth:`RoutingHooks.take_agreement_counts`'s counts (read on the
    host); None if nothing was replayed."""
    if float(counts[:, 1].sum()) == 0:
        return None
    return (counts[:, 0] / counts[:, 1].clamp_min(1)).tolist()
