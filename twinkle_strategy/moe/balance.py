"""Load balancing over the global batch: the model's own auxiliary loss, and aux-loss-free bias updates.

transformers computes an MoE model's load-balancing loss (Switch Transformer's
``E * sum_e f_e * P_e``, ``load_balancing_loss_func`` in Mixtral, Qwen2/3-MoE,
OLMoE, Jamba, gpt-oss...) from the router logits of one forward, so under
data parallelism each rank balances its own micro-batch: ``f_e``, the fraction
of tokens routed to expert ``e``, comes from a few sequences and pushes every
micro-batch towards uniform routing, which fights specialisation (Qwen's
global-batch balancing). Here ``f_e`` is counted over the global batch (every
rank, every micro-batch of the optimizer step) and only ``P_e``, the mean
router probability, carries gradient; each (rank, micro-batch) contributes
``E * sum_e f_e * p_e / R`` with ``p_e`` its local probability sum and ``R``
the global row count, so the parts add up to the loss one process would
compute on the concatenated batch.

The formula is the model's: :meth:`BalancingLoss.check_matches_model` refuses a
family whose own loss is not this form, rather than silently changing its
objective (see :mod:`twinkle_strategy.moe.balance_form` for how, in bf16 too).

Routers with a correction bias (DeepSeek-V3's ``e_score_correction_bias``)
can instead be balanced without a loss: :func:`update_correction_bias` nudges
the bias after each step from the global expert counts, as torchtitan's
``load_balance_coeff`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.balance_form import switch_form_problem


@dataclasses.dataclass
class RouterStats:
    """Sums over all MoE layers' router rows, as ``load_balancing_loss_func`` accumulates them."""

    counts: torch.Tensor  # [E] top-k assignments per expert (no gradient)
    prob_sums: torch.Tensor  # [E] summed router probabilities (carries the gradient)
    rows: torch.Tensor  # scalar: non-padding rows over all layers

    def reduced(self) -> RouterStats:
        """Counts and rows summed over every rank (probabilities stay local: they carry this rank's graph)."""
        packed = torch.cat([self.counts, self.rows.reshape(1)]).detach()
        if dist.is_initialized():
            dist.all_reduce(packed)
        return RouterStats(packed[:-1], self.prob_sums, packed[-1])

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.counts + other.counts, self.prob_sums + other.prob_sums, self.rows + other.rows)


@dataclasses.dataclass(frozen=True)
class BalancingLoss:
    """Where a model keeps its load-balancing loss: the causal LM module and its routing sizes."""

    owner: nn.Module  # the module with router_aux_loss_coef (the CausalLM, beneath any PEFT wrapper)
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, model: nn.Module) -> BalancingLoss:
        # The module that holds the coefficient itself: PEFT's wrappers forward attribute reads to the model they
        # wrap (hasattr is true on them), so setting it there would leave the model's own term in its loss.
        owner = next((m for m in model.modules() if "router_aux_loss_coef" in vars(m)), None)
        config = getattr(owner, "config", None)
        if owner is None or not hasattr(config, "output_router_logits"):
            raise ModelStructureError(
                f"{type(model).__name__} has no load-balancing loss of its own (no router_aux_loss_coef / "
                "output_router_logits); set router_aux_loss_coef=0, and for routers with a correction bias "
                "(DeepSeek-V3 style) use load_balance_coeff instead")
        return cls(owner, int(owner.num_experts), int(owner.num_experts_per_tok))

    def silence_model_term(self) -> None:
        """The model would add ``coef * local aux loss`` to its loss; the global one replaces it."""
        self.owner.router_aux_loss_coef = 0.0

    def statistics(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
                   chosen: list[torch.Tensor | None] | None = None, *, in_logits_dtype: bool = False) -> RouterStats:
        """The model formula's per-expert sums for one forward (softmax, top-k, masked by attention). ``chosen``:
        per layer, the experts the forward used where they are not the router's top-k (routing replay). The
        softmax in fp32; ``in_logits_dtype``: in the logits' dtype, top-k on those rounded probabilities, as
        transformers' ``load_balancing_loss_func`` takes them (for comparing with a model's own value)."""
        device = router_logits[0].device
        counts = torch.zeros(self.num_experts, device=device)
        prob_sums = torch.zeros(self.num_experts, device=device)
        rows = torch.zeros((), device=device)
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        for layer, logits in enumerate(router_logits):
            if in_logits_dtype:
                rounded = F.softmax(logits.to(device), dim=-1)
                top, probs = torch.topk(rounded, self.top_k, dim=-1).indices, rounded.float()
            else:
                probs = F.softmax(logits.to(device), dim=-1, dtype=torch.float32)
                top = torch.topk(probs, self.top_k, dim=-1).indices
            used = None if chosen is None or layer >= len(chosen) else chosen[layer]
            used = used if used is not None and used.shape[0] == probs.shape[0] else None
            chosen_here = top if used is None else used.to(device)
            weight = torch.ones(probs.shape[0], device=device) if mask is None else mask
            counts = counts.scatter_add(0, chosen_here.reshape(-1), weight.repeat_interleave(self.top_k).detach())
            prob_sums = prob_sums + (probs * weight.unsqueeze(-1)).sum(dim=0)
            rows = rows + weight.sum()
        return RouterStats(counts, prob_sums, rows)

    def loss_part(self, local: RouterStats, global_stats: RouterStats) -> torch.Tensor:
        """This forward's share of the global-batch loss: summed over ranks and micro-batches it is the loss."""
        fraction = global_stats.counts / global_stats.rows
        return self.num_experts * torch.sum(fraction * local.prob_sums / global_stats.rows)

    def local_loss(self, local: RouterStats) -> torch.Tensor:
        """The loss on this forward's statistics alone: what the model itself computes."""
        return self.loss_part(local, RouterStats(local.counts, local.prob_sums, local.rows))

    def check_matches_model(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
                            model_aux_loss: torch.Tensor | None) -> bool:
        """Refuse a family whose own load-balancing loss is not the formula made global here (in any dtype); True
        once judged, False for a forward of padding only (either form is 0/0 there: the next forward is judged)."""
        if attention_mask is not None and not bool(attention_mask.detach().any()):
            return False
        problem = switch_form_problem(self, router_logits, attention_mask, model_aux_loss)
        if problem is not None:
            raise ModelStructureError(
                f"router_aux_loss_coef: {type(self.owner).__name__}'s load-balancing loss is not the "
                f"Switch-Transformer form counted over the global batch here: {problem}; {self.fix()}")
        return True

    def fix(self) -> str:
        """What to do instead, keeping load balancing where the model allows it."""
        if correction_biases(self.owner):
            return ("set router_aux_loss_coef=0 and balance with load_balance_coeff > 0 instead (aux-loss-free "
                    "updates of its routers' e_score_correction_bias)")
        return ("set router_aux_loss_coef=0 for this model (it then trains without load balancing: its routers have "
                "no e_score_correction_bias for load_balance_coeff)")


@dataclasses.dataclass
class GlobalBatchAuxLoss:
    """The model's load-balancing loss, counted over the global batch, in place of its own local one.

    Shared by twinkle's Trainer and the ``transformers.Trainer`` mixin: each training forward of a
    (rank, micro-batch) adds ``coef * share`` to its loss; the shares add up, over ranks and micro-batches,
    to the loss one process computes on the concatenated batch.
    """

    balancing: BalancingLoss
    coef: float
    checked: bool = False  # the model's own aux loss was compared with ours once

    @classmethod
    def replacing_model_term(cls, model: nn.Module, *, coef: float) -> GlobalBatchAuxLoss:
        balancing = BalancingLoss.of(model)
        balancing.silence_model_term()
        return cls(balancing, coef)

    def share(self, outputs, attention_mask: torch.Tensor | None, router: RouterStats | None,
              chosen: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, RouterStats]:
        """This forward's share of the global aux loss (``outputs`` from a forward with ``output_router_logits``),
        and the global statistics it used: ``router`` (from :meth:`prepass`), or with ``None`` this forward's own
        statistics summed over ranks (a collective: every rank must call it)."""
        if getattr(outputs, "router_logits", None) is None:
            raise ModelStructureError(f"router_aux_loss_coef: {type(self.balancing.owner).__name__} returned no "
                                      "router_logits with output_router_logits=True; set router_aux_loss_coef=0")
        if not self.checked and chosen is None:  # (the model's own loss counts its router's top-k)
            self.checked = self.balancing.check_matches_model(outputs.router_logits, attention_mask,
                                                              getattr(outputs, "aux_loss", None))
        local = self.balancing.statistics(outputs.router_logits, attention_mask, chosen)
        router = router if router is not None else local.reduced()
        return self.balancing.loss_part(local, router), router

    @torch.no_grad()
    def prepass(self, model: nn.Module, batches: Iterable[dict], *, expert_load=None,
                replay_of: Callable[[dict], tuple[dict, contextlib.AbstractContextManager]] | None = None) -> RouterStats:
        """Router statistics of every micro-batch of a step (on the device; labels are left out), summed over
        ranks: one forward without gradients each, so that the first micro-batch's backward already sees the
        whole global batch. ``expert_load``: a load counter (``.active``) paused meanwhile, since the training
        forwards count the load. ``replay_of``: the strategy's ``replay_of_batch``, for batches that carry a
        routing record (the experts they will use are counted)."""
        if expert_load is not None:
            expert_load.active = False
        try:
            total = None
            for batch in batches:
                inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
                inputs, replay = replay_of(inputs) if replay_of is not None else (inputs, contextlib.nullcontext())
                with replay as replayed:
                    out = model(**inputs, output_router_logits=True)
                chosen = getattr(replayed, "used", None)
                stats = self.balancing.statistics(out.router_logits, inputs.get("attention_mask"), chosen)
                total = stats if total is None else total + stats
            return total.reduced()
        finally:
            if expert_load is not None:
                expert_load.active = True


def correction_biases(model: nn.Module) -> list[torch.Tensor]:
    """The routers' ``e_score_correction_bias`` tensors, one per MoE layer in module order."""
    return [t for name, t in model.named_buffers() if name.endswith("e_score_correction_bias")] + \
        [t for name, t in model.named_parameters() if name.endswith("e_score_correction_bias")]


@torch.no_grad()
def update_correction_bias(biases: list[torch.Tensor], counts: torch.Tensor, coeff: float) -> None:
    """torchtitan's aux-loss-free rule: raise the bias of under-loaded experts, lower over-loaded ones.

    ``counts`` [layers, E] are the global tokens per expert of the step; the
    update is ``coeff * sign(mean - count)``, centred so the biases do not drift.
    """
    if len(biases) != counts.shape[0]:
        raise ModelStructureError(f"load_balance_coeff: {counts.shape[0]} MoE layers counted but {len(biases)} "
                                  "routers have an e_score_correction_bias")
    for bias, layer_counts in zip(biases, counts, strict=True):
        layer_counts = layer_counts[:bias.numel()].float()
        delta = coeff * torch.sign(layer_counts.mean() - layer_counts)
        bias.add_((delta - delta.mean()).to(bias.device, bias.dtype))
