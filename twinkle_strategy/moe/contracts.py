"""How an MoE block calls its experts module: the contracts expert parallelism can serve.

EP gives an experts module a forward that sends each token to the rank owning
its expert and runs the module's own forward there, on this rank's experts only
(:mod:`.parallel_experts`). That is right only if we know how the block calls the module and
where the module keeps its experts, so we read both from the code: the
forward's signature, the calls the block makes (its source, with ``ast``) and
the parameters the module holds. Anything else is refused at ``wrap_model``
with a :class:`ModelStructureError` naming the module and what differs; a model
we cannot serve must neither crash at its first forward nor train wrongly.

Served (transformers 5.2x):

* **routed**: ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
  returning ``sum_j w_j * expert_{e_j}(x)``, with every expert tensor a
  parameter of the module itself, expert on dim 0: ``gate_up_proj``/``down_proj``,
  non-gated ``up_proj``/``down_proj`` (Nemotron-H), transposed with biases
  (gpt-oss, which names the inputs ``router_indices``/``routing_weights``).
  LongCat-Flash adds zero-computation experts: its counts are
  ``num_routed_experts`` + ``zero_expert_num``, indices past the routed ones
  are the identity, and ``gate_up_proj`` stores a (never read) slot for each.
* **pre-routed**: Llama-4's ``Llama4TextExperts``, called as ``experts(routed_in)``
  where the block has repeated every token once per expert and scaled it by
  its router score. We recognise that forward itself, not its shape: another
  one-argument forward may mean anything.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import textwrap

from torch import nn

from twinkle_strategy.errors import ModelStructureError
from twinkle_strategy.moe.class_swap import unswapped_class


class CallKind(str, enum.Enum):
    """How a block calls its experts module."""

    ROUTED = "routed"  # experts(hidden_states, top_k_index, top_k_weights): the router's choices
    PRE_ROUTED = "pre_routed"  # Llama-4: experts(routed_in), tokens already repeated per expert


# Input names of the routed call: (tokens, chosen experts, their weights).
ROUTED_SIGNATURES = (
    ("hidden_states", "top_k_index", "top_k_weights"),
    ("hidden_states", "router_indices", "routing_weights"),  # gpt-oss
)
CALL_ARITY = {CallKind.ROUTED: 3, CallKind.PRE_ROUTED: 1}


@dataclasses.dataclass(frozen=True)
class ExpertsContract:
    kind: CallKind
    num_experts: int  # routed experts: the ones EP splits across ranks
    zero_experts: int = 0  # identity experts after them (LongCat-Flash): applied where the token is
    # Fewest choices per token the forward handles: LongCat-Flash's squeezes the top-k dimension
    # away, which breaks with a single choice.
    min_top_k: int = 1


def _forward_inputs(cls: type) -> tuple[str, ...]:
    """Names of the forward's inputs after ``self``; ``*args``/``**kwargs`` shown as such."""
    # inspect.signature follows __wrapped__, so transformers' @use_experts_implementation
    # (which swaps the forward for a dispatcher over implementations) shows the model's own.
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    shown = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            shown.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        elif p.kind is not p.KEYWORD_ONLY or p.default is p.empty:
            shown.append(p.name)
    return tuple(shown)


def _is_llama4_text_experts_forward(cls: type) -> bool:
    try:
        from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
    except ImportError:
        return False
    return inspect.unwrap(cls.forward) is inspect.unwrap(Llama4TextExperts.forward)


@functools.cache
def experts_call_arities(block_class: type, attr: str) -> frozenset[int]:
    """How many arguments the block's code passes in each ``self.<attr>(...)`` call.

    Read from the source of the block's classes (its MRO up to ``nn.Module``).
    Empty when the source is not available or the call is made elsewhere; the
    forward's signature is then the only evidence.
    """
    arities: set[int] = set()
    for cls in block_class.__mro__:
        if cls in (nn.Module, object):
            break
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                arities.add(len(node.args) + len(node.keywords))
    return frozenset(arities)


def expert_counts(inner: nn.Module) -> tuple[int, int] | None:
    """(routed experts, zero-computation experts) from the module's own attributes, or None."""
    if _has_zero_experts(inner):
        return inner.num_routed_experts, inner.zero_expert_num
    if isinstance(getattr(inner, "num_experts", None), int):
        return inner.num_experts, 0
    return None


def _has_zero_experts(inner: nn.Module) -> bool:
    """LongCat-Flash's counts: routed experts, then zero-computation (identity) experts."""
    return isinstance(getattr(inner, "num_routed_experts", None), int) and isinstance(
        getattr(inner, "zero_expert_num", None), int)


def set_local_expert_counts(inner: nn.Module, contract: ExpertsContract, local: int) -> None:
    """Point the module's count attributes (which its forward reads) at this rank's ``local`` experts."""
    zero = contract.zero_experts * local // contract.num_experts
    for attr, value in (("num_experts", local), ("num_routed_experts", local), ("zero_expert_num", zero),
                        ("total_experts", local + zero)):
        if isinstance(getattr(inner, attr, None), int):
            setattr(inner, attr, value)


def _shapes(params) -> str:
    return ", ".join(f"{name} {tuple(p.shape)}" for name, p in params)


def read_contract(fqn: str, block: nn.Module, inner: nn.Module, attr: str, family: str) -> ExpertsContract:
    """The contract of the experts module ``inner`` (at ``fqn``, child ``attr`` of ``block``), or a clear refusal.

    Read from the model's own class, also once EP has swapped it (discovery runs again after ``wrap_model``).
    """
    cls = unswapped_class(type(inner))
    where = f"{fqn} ({cls.__name__}, called by {type(block).__name__})"

    def refuse(what: str) -> ModelStructureError:
        return ModelStructureError(
            f"{family} is not supported with ep_size > 1 yet: {where} {what}. Expert parallelism serves experts "
            "modules called as experts(hidden_states, top_k_index, top_k_weights) that hold fused expert tensors "
            "(expert on dim 0), and Llama-4's pre-routed experts. Use ep_size=1 (FSDP only) for this model"
        )

    if isinstance(inner, (nn.ModuleList, nn.ModuleDict)):
        raise refuse("is a list of per-expert modules, not fused expert tensors")
    inputs = _forward_inputs(cls)
    if inputs in ROUTED_SIGNATURES:
        kind = CallKind.ROUTED
    elif _is_llama4_text_experts_forward(cls):
        kind = CallKind.PRE_ROUTED
    else:
        expected = " or ".join(f"forward({', '.join(s)})" for s in ROUTED_SIGNATURES)
        raise refuse(f"has forward({', '.join(inputs)}), which is no experts call we have a dispatch for "
                     f"(expected {expected}, or Llama4TextExperts.forward)")
    arities = experts_call_arities(type(block), attr)
    if arities and arities != {CALL_ARITY[kind]}:
        raise refuse(f"is called with {sorted(arities)} argument(s) by {type(block).__name__}, but its "
                     f"forward({', '.join(inputs)}) takes {CALL_ARITY[kind]}")

    counts = expert_counts(inner)
    if counts is None:
        raise refuse("has no integer num_experts (or num_routed_experts + zero_expert_num) attribute, so the "
                     "number of experts its forward indexes is unknown")
    num, zero = counts
    nested = [(name, p) for name, p in inner.named_parameters() if "." in name]
    if nested:
        raise refuse(f"keeps parameters in child modules ({_shapes(nested)}): only tensors the experts module "
                     "holds itself, one expert per index of dim 0, can be split across EP ranks")
    own = list(inner.named_parameters(recurse=False))
    allowed = {num, num + zero}
    odd = [(name, p) for name, p in own if p.dim() < 2 or p.shape[0] not in allowed]
    if not own or odd:
        raise refuse(f"has parameters that do not hold its {num} experts on dim 0 ({_shapes(odd or own) or 'none'})")
    return ExpertsContract(kind, num, zero, min_top_k=2 if _has_zero_experts(inner) else 1)
