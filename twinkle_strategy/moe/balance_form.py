"""Is a model's own load-balancing loss the Switch-Transformer form that the global-batch loss counts? In any dtype.

The global-batch loss (:mod:`twinkle_strategy.moe.balance`) replaces the model's own term, so it must be the same
formula, ``E * sum_e f_e * P_e`` over the router logits of the forward. Comparing the model's ``aux_loss`` with
ours at a fixed tolerance holds in fp32 only: in bf16 transformers' ``load_balancing_loss_func`` takes the softmax
in bf16 (probabilities rounded to 8 significand bits) and its top-k on those rounded probabilities, where ours
takes both in fp32 from the same logits. The rounding moves ``P_e`` by about ``u = 2^-8`` relative, and where the
rounding ties or reorders two probabilities a token is counted for another expert, which moves ``f_e`` by a whole
token: no tolerance in units of ``u`` bounds that (the demo model at 1x2 in bf16: 2.3782 against 2.3932).

So the question is split in two, each asked where it has an exact answer:

1. **The form, in fp32.** The family's own function (the ``load_balancing_loss_func`` its forward calls, found by
   :func:`~twinkle_strategy.compat.transformers_internals.balancing_loss_function`) and ours evaluate the same
   router logits cast to fp32 with the same mask: the same probabilities, the same top-k, only the order of the
   fp32 sums differs, a few fp32 roundings of sums over the rows (``log2(rows) * 2^-24``, about 1e-6 at a million
   rows). :data:`FORM_TOLERANCE` = 1e-5 relative; another formula gives another number, not a rounding of
   the same one.
2. **The forward returns that function's value.** The ``aux_loss`` the forward returned is that function on the
   logits as the forward had them: in their own dtype, or in fp32 where autocast computed the softmax in fp32
   (CUDA autocast lists softmax among its fp32 operations). The same function on the same inputs repeats its
   operations exactly; :data:`SAME_FUNCTION_TOLERANCE` (16 fp32 units of roundoff, relative) only leaves room
   for a backend that reduces in another order on another call. A subclass whose forward computes another
   formula, or a function replaced in the modeling module, fails one of the two.

Where the model's module has no such function (remote code), the returned ``aux_loss`` is compared with ours
computed as transformers' Switch functions compute it, the softmax and top-k in the logits' dtype and the sums
in fp32 (or all in fp32, for a model that upcasts): equal up to the order of fp32 sums, so
:data:`FALLBACK_TOLERANCE` = 1e-4 relative, the tolerance the fp32 comparison always had.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from twinkle_strategy.compat.transformers_internals import balancing_loss_function


class BalancingLoss(Protocol):
    """What this check reads of :class:`twinkle_strategy.moe.balance.BalancingLoss` (a protocol, so that the two
    modules do not import each other)."""

    owner: nn.Module
    num_experts: int
    top_k: int

    def statistics(self, router_logits, attention_mask, chosen=None, *, in_logits_dtype: bool = False): ...

    def local_loss(self, local) -> torch.Tensor: ...

FORM_TOLERANCE = 1e-5  # the family's function against ours, both in fp32 on the same logits
SAME_FUNCTION_TOLERANCE = 16 * 2.0 ** -24  # the returned aux_loss against the same function on the same logits
FALLBACK_TOLERANCE = 1e-4  # no module function: the returned aux_loss against ours rounded as transformers rounds


def switch_form_problem(balancing: BalancingLoss, router_logits: tuple[torch.Tensor, ...],
                        attention_mask: torch.Tensor | None, model_aux_loss: torch.Tensor | None) -> str | None:
    """Why the model's load-balancing loss is not the Switch form, in words for an error message; None if it is."""
    if model_aux_loss is None:
        return "its forward returned no aux_loss with output_router_logits=True"
    returned = float(model_aux_loss.detach())
    logits = tuple(router_logits)
    fp32_logits = tuple(t.detach().float() for t in logits)
    family = balancing_loss_function(balancing.owner)
    with torch.no_grad():
        if family is None:
            return _fallback_problem(balancing, logits, attention_mask, returned)
        theirs = float(family(fp32_logits, balancing.num_experts, balancing.top_k, attention_mask))
        ours = float(balancing.local_loss(balancing.statistics(fp32_logits, attention_mask)))
        if not _close(theirs, ours, FORM_TOLERANCE):
            return (f"its modeling module's {family.__name__} gives {theirs} where the Switch form gives {ours}, on "
                    "the same router logits in fp32")
        expected = [float(family(tuple(t.detach() for t in logits), balancing.num_experts, balancing.top_k,
                                 attention_mask)), theirs]
    if not any(_close(returned, value, SAME_FUNCTION_TOLERANCE) for value in expected):
        return (f"its forward returned aux_loss {returned}, not its modeling module's {family.__name__} on its own "
                f"router logits ({expected[0]}; {expected[1]} in fp32)")
    return None


def _fallback_problem(balancing: BalancingLoss, logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
                      returned: float) -> str | None:
    logits = tuple(t.detach() for t in logits)
    ours = [float(balancing.local_loss(balancing.statistics(logits, attention_mask, in_logits_dtype=True))),
            float(balancing.local_loss(balancing.statistics(logits, attention_mask)))]
    if any(_close(returned, value, FALLBACK_TOLERANCE) for value in ours):
        return None
    return (f"it returned aux_loss {returned} where the Switch form gives {ours[0]} on its router logits "
            f"({ours[1]} in fp32)")


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(1.0, abs(b))
