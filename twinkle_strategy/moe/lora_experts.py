"""The experts' compute with LoRA on the activations: ``W + BA`` is never formed.

PEFT's ``target_parameters`` wraps an experts module in one ``ParamWrapper`` per fused tensor
(``gate_up_proj``, ``down_proj``). In each forward, PEFT's wrapper makes the tensor ``W + scale * BA``
(a parametrization) and calls the experts' own forward, so autograd keeps a second copy of every local
expert's weights until the backward, layer after layer. Here, each expert computes instead

    y = x @ W_e  +  scale * ((x @ A_e) @ B_e)        (in the orientation the family multiplies W_e)

so autograd keeps, beside views of ``W`` (``W[e]`` and ``W.transpose`` are views; no copy), the rank-sized
``x @ A_e`` and what ``x`` is recomputed from in the backward (:func:`read_with_low_rank`): A's gradient needs
``x``, which the frozen base alone would not keep. The up projection's rows are a gather of the module's
input (each token ``top_k`` times): the input and the index are kept, the rows regathered. The down
projection's input is the gate of ``gate_up``, which is kept (the gate's own backward keeps it anyway): the
gate is recomputed. Exactly the same ops: the same numbers. Llama-4's batched path keeps its up projection's
input (the module's input itself: nothing to regather) and recomputes its gate likewise. Under expert
parallelism the rows are those this rank receives: the region reads them from the tokens before the
dispatch, so its recomputation sends them again (one more all-to-all per layer, in the backward) and the
tokens, not ``top_k`` rows per token, are kept (:class:`~twinkle_strategy.moe.row_source.RowSource`). Inside
layer-level activation checkpointing, whose record keeps the rows received anyway, the rows are at hand.

:func:`compute_lora_on_activations` swaps the class of the OUTERMOST ``ParamWrapper`` of each experts
module whose fused tensors carry LoRA (:mod:`.class_swap`: the instance, its parameters, their names and
PEFT's adapter names stay, so state dicts, saves and ``save_pretrained`` are PEFT's own). Under expert
parallelism :class:`~twinkle_strategy.moe.parallel_experts.ExpertParallelExperts` is swapped on top: it
routes and dispatches, and its ``own_forward`` reaches :class:`LoraOnActivationsExperts` for the local
experts.

The compute follows the experts' call contract (:mod:`.contracts`) and the layout transformers records
on each experts class with ``@use_experts_implementation`` (``has_gate``, ``has_bias``,
``is_transposed``, ``has_post_expert_norm``, ``_apply_gate``, ``act_fn``), plus Llama-4's pre-routed
experts and LongCat-Flash's zero-computation experts, which transformers does not decorate:

* **grouped** (``torch.nn.functional.grouped_mm``) where the model's ``config._experts_implementation``
  is ``grouped_mm`` and the kernel takes the tensors (CPU, or CUDA bf16 on SM80+, 16-byte strides; the
  LoRA rank is zero-padded to 16 bytes, which adds exact zeros);
* **per expert** (like transformers' eager forward) otherwise; **batched** (``bmm``) for Llama-4.

Anything it cannot serve exactly runs PEFT's own forward for that call (``ParamWrapper.forward``):
several active adapters, disabled or merged adapters, ``adapter_names``, a single expert slot, a tensor
dtype PEFT upcasts (float8), transformers' own expert parallelism. An experts class whose layout is not
known is never swapped. ``lora_experts: peft`` (:class:`~twinkle_strategy.config.LoraExperts`) keeps
PEFT's path everywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from twinkle_strategy.compat.transformers_internals import (
    experts_gate,
    experts_implementation,
    lora_delta_factors,
    under_transformers_expert_parallel,
)
from twinkle_strategy.moe.class_swap import swap_class, unswapped_class
from twinkle_strategy.moe.contracts import CallKind
from twinkle_strategy.moe.discovery import EXPERTS_ATTR, unwrap_experts
from twinkle_strategy.moe.row_source import ReadsRowSource, RowSource

# Dtypes PEFT folds the delta into W in (others, e.g. float8, it upcasts: PEFT's own path serves them).
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_ALIGNMENT_BYTES = 16  # grouped_mm's kernels want every non-unit stride a multiple of 16 bytes


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How one experts class computes an expert, read once from the module (see :func:`read_layout`)."""

    kind: CallKind  # routed (router's choices) or pre-routed (Llama-4: tokens repeated per expert)
    gated: bool  # gate_up_proj then a gate, or (Nemotron-H) up_proj then act_fn
    weight_on_right: bool  # x @ W[e] (gpt-oss, Llama-4: [E, in, out]) or F.linear(x, W[e]) ([E, out, in])
    has_bias: bool  # <name>_bias per expert (gpt-oss)
    has_post_expert_norm: bool  # post_expert_norm after down_proj
    has_zero_experts: bool  # LongCat-Flash: indices from num_routed_experts on are the identity

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"


def _forward_is(cls: type, module_path: str, class_name: str) -> bool:
    """Whether ``cls``'s forward is transformers' ``class_name``'s own (the decorator's wrapper unwrapped)."""
    try:
        module = __import__(module_path, fromlist=[class_name])
    except ImportError:
        return False
    known = getattr(module, class_name, None)
    return known is not None and inspect.unwrap(cls.forward) is inspect.unwrap(known.forward)


def _dispatches(cls: type) -> bool:
    """Whether ``cls.forward`` is ``@use_experts_implementation``'s dispatcher (a ``functools.wraps`` of the
    decorated class's own forward), not a forward a subclass wrote."""
    owner = next(base for base in cls.__mro__ if "forward" in vars(base))
    return hasattr(vars(owner)["forward"], "__wrapped__") and experts_gate(owner) is not None


def read_layout(inner: nn.Module) -> ExpertsLayout | None:
    """The layout of the experts module ``inner`` (the model's class), or None for one we do not know."""
    cls = unswapped_class(type(inner))
    if _forward_is(cls, "transformers.models.llama4.modeling_llama4", "Llama4TextExperts"):
        # bmm(x [E, T, H], gate_up_proj [E, H, 2I]); gate, up = chunk; up * act(gate)
        return ExpertsLayout(CallKind.PRE_ROUTED, gated=True, weight_on_right=True, has_bias=False,
                             has_post_expert_norm=False, has_zero_experts=False)
    if _forward_is(cls, "transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts"):
        # F.linear(x, gate_up_proj[e]); act(gate) * up; identity experts past num_routed_experts
        return ExpertsLayout(CallKind.ROUTED, gated=True, weight_on_right=False, has_bias=False,
                             has_post_expert_norm=False, has_zero_experts=True)
    # @use_experts_implementation records the layout on every instance; its grouped_mm and batched_mm forwards
    # (the same numbers as the class's eager one) compute from these attributes alone, and so do we. Only
    # while the forward the module runs is that decorator's dispatcher: a subclass with its own forward
    # (another call, other math) inherits the attributes but not their meaning.
    recorded = ("has_gate", "has_bias", "is_transposed")
    if not all(isinstance(getattr(inner, name, None), bool) for name in recorded) or not _dispatches(cls):
        return None
    # (transformers before 5.24 records no has_post_expert_norm: no family of theirs had one.)
    return ExpertsLayout(CallKind.ROUTED, gated=inner.has_gate, weight_on_right=inner.is_transposed,
                         has_bias=inner.has_bias, has_post_expert_norm=getattr(inner, "has_post_expert_norm", False),
                         has_zero_experts=False)


@dataclasses.dataclass(frozen=True)
class LoraFactors:
    """One adapter's LoRA on a fused tensor: its delta is ``scaling * lhs @ rhs``, ``lhs`` [E, d1, r] and
    ``rhs`` [E, r, d2] (d1, d2: one expert's slice of the tensor), as PEFT's ``get_delta_weight`` lays out its
    ``lora_A``/``lora_B`` (:func:`~twinkle_strategy.compat.transformers_internals.lora_delta_factors`)."""

    lhs: torch.Tensor
    rhs: torch.Tensor
    scaling: float


@dataclasses.dataclass(frozen=True)
class Projection:
    """One fused expert tensor ``weight`` [E, d1, d2] with its bias and LoRA, as the family multiplies it."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # [E, out]
    lora: LoraFactors | None
    weight_on_right: bool  # x @ weight[e]; else F.linear(x, weight[e])

    def _lora_in_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(down [E, in, r], up [E, r, out]): the LoRA branch is ``(x @ down[e]) @ up[e]``."""
        lora = self.lora
        if self.weight_on_right:  # x @ (W + s * lhs @ rhs)
            return lora.lhs, lora.rhs
        # F.linear(x, W + s * lhs @ rhs) = x @ W^T + s * (x @ rhs^T) @ lhs^T
        return lora.rhs.transpose(-2, -1), lora.lhs.transpose(-2, -1)

    def low_rank_in(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """The LoRA branch's first, rank-sized product ``x @ A_e`` for expert ``expert``'s rows ``x`` [n, in]."""
        down, _ = self._lora_in_out()
        return x @ down[expert]

    def per_expert(self, x: torch.Tensor, low_rank_in: torch.Tensor | None, expert: int) -> torch.Tensor:
        """Expert ``expert`` on its rows ``x`` [n, in], ``low_rank_in`` its :meth:`low_rank_in` (None without LoRA)."""
        w = self.weight[expert]  # a view: autograd saves it without a copy
        out = x @ w if self.weight_on_right else F.linear(x, w)
        if self.lora is not None:
            _, up = self._lora_in_out()
            out = out + self.lora.scaling * (low_rank_in @ up[expert])
        if self.bias is not None:
            out = out + self.bias[expert]
        return out

    def batched_low_rank_in(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ A_e`` for every expert's block of ``x`` [E, T, in]."""
        down, _ = self._lora_in_out()
        return torch.bmm(x, down)

    def batched(self, x: torch.Tensor, low_rank_in: torch.Tensor | None) -> torch.Tensor:
        """Every expert on its block of ``x`` [E, T, in] (Llama-4's pre-routed layout: weight on the right)."""
        out = torch.bmm(x, self.weight)
        if self.lora is not None:
            _, up = self._lora_in_out()
            out = out + self.lora.scaling * torch.bmm(low_rank_in, up)
        return out

    def grouped_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight [E, in, out], LoRA down [E, in, r'], LoRA up [E, r', out]) for ``grouped_mm``, the rank
        zero-padded to ``r'`` (16 bytes): the padding adds exact zeros. The base weight stays a view."""
        weight = self.weight if self.weight_on_right else self.weight.transpose(-2, -1)
        if self.lora is None:
            return weight, None, None
        down, up = self._lora_in_out()
        per_row = _GROUPED_ALIGNMENT_BYTES // down.element_size()
        pad = -down.shape[-1] % per_row
        return weight, F.pad(down, (0, pad)).contiguous(), F.pad(up, (0, 0, 0, pad)).contiguous()

    def grouped(self, x: torch.Tensor, low_rank_in: torch.Tensor | None, offsets: torch.Tensor,
                expert_of_row: torch.Tensor, operands: GroupedOperands) -> torch.Tensor:
        """Every row of ``x`` [S, in] (sorted by expert, ``offsets`` the groups' ends, in the weight's dtype)
        through its expert; ``low_rank_in`` the rows' ``x @ A_e`` (:func:`grouped_low_rank_in`)."""
        weight, _, up = operands
        out = F.grouped_mm(x, weight, offs=offsets)
        if up is not None:
            out = out + self.lora.scaling * F.grouped_mm(low_rank_in, up, offs=offsets)
        if self.bias is not None:
            out = out + self.bias[expert_of_row]
        return out


GroupedOperands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # Projection.grouped_operands


def grouped_low_rank_in(x: torch.Tensor, offsets: torch.Tensor, operands: GroupedOperands) -> torch.Tensor:
    """Every row's ``x @ A_e`` [S, r'] (rows sorted by expert), for :meth:`Projection.grouped`."""
    return F.grouped_mm(x, operands[1], offs=offsets)


def read_with_low_rank(read, inputs: tuple[torch.Tensor, ...], low_rank_in) -> tuple:
    """``x = read(*inputs)`` and, where ``low_rank_in`` is given (the projection has LoRA), ``low_rank_in(x)``:
    the LoRA branch's rank-sized first product(s), ``x @ A_e``. Returns ``(x, low_rank_in(x) or None)``.

    A's gradient needs ``x``, and ``x`` is larger than what it is read from: the rows each expert reads are
    the layer's tokens gathered ``top_k`` times (``read`` = a gather), the down projection's input is the gate of
    the up projection's output (``read`` = the gate, whose own backward keeps that output anyway). So only
    ``inputs`` are kept for the backward, and ``x`` and the product are recomputed from them there: a gather
    or an element-wise gate, and the rank-sized GEMM (about 1% of the base GEMM's FLOPs). The same ops
    recompute the same numbers. The base GEMM consumes ``x`` in the forward without keeping it (its weight
    is frozen). ``torch.utils.checkpoint`` (non-reentrant) rather than a custom ``autograd.Function``:
    the recomputation reuses autograd's own backward of every op (grouped_mm's with offsets, the gather's,
    gpt-oss's clamped gate), so the gradients are those of the plain compute by construction, and it nests
    inside the layer-level checkpointing of :mod:`.recompute`.
    """
    if low_rank_in is None:
        return read(*inputs), None
    if not torch.is_grad_enabled():
        x = read(*inputs)
        return x, low_rank_in(x)

    def region(*kept):
        x = read(*kept)
        return x, low_rank_in(x)

    return checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=False)


def _aligned(hidden_size: int, operands: list[torch.Tensor]) -> bool:
    """Whether ``grouped_mm`` takes the operands [E, k, n] and the rows [S, hidden_size] (and every
    intermediate [S, k]): 16-byte aligned offsets, sizes and non-unit strides. (Storages themselves are
    allocator-aligned; offsets are read, not data pointers, so the planner's fake tensors trace this too.)"""
    for t in operands:
        size = t.element_size()
        sizes = (hidden_size, *t.shape[-2:])
        if (t.storage_offset() * size) % _GROUPED_ALIGNMENT_BYTES or \
                any((n * size) % _GROUPED_ALIGNMENT_BYTES for n in sizes):
            return False
        if any(stride != 1 and (stride * size) % _GROUPED_ALIGNMENT_BYTES for stride in t.stride()):
            return False
    return True


def _grouped_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a grouped_mm kernel for rows of ``dtype`` on ``device``."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":  # documented: bf16 on SM80+
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


class LoraOnActivationsExperts(ReadsRowSource, nn.Module):
    """Mixin for PEFT's outermost ``ParamWrapper`` around an experts module: LoRA on the activations.

    Never instantiated: :func:`compute_lora_on_activations` puts it in front of the wrapper's class and sets
    :attr:`experts_layout`. ``super().forward`` is PEFT's own (the fallback). Under expert parallelism the
    rows come as a :class:`~twinkle_strategy.moe.row_source.RowSource` (:meth:`forward_reading`): the rows
    this rank receives travel inside the region that reads them, and again in the backward, so they are
    not kept.
    """

    experts_layout: ExpertsLayout

    def forward(self, *args, **kwargs):
        projections = self._projections(kwargs)
        if projections is None:  # not exactly servable here: PEFT's own forward, which forms W + BA
            return super().forward(*args, **kwargs)
        inner, _ = unwrap_experts(self)
        if self.experts_layout.kind == CallKind.PRE_ROUTED:
            return self._pre_routed(inner, projections, *args, **kwargs)
        return self._routed_tokens(inner, projections, *args, **kwargs)

    def forward_reading(self, rows: RowSource, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed forward on rows still to be read (expert parallelism's received rows)."""
        projections = self._projections({})
        if projections is None:
            return super().forward(rows.read_now(), top_k_index, top_k_weights)
        inner, _ = unwrap_experts(self)
        return self._routed(inner, projections, rows, top_k_index, top_k_weights)

    # ------------------------------------------------------------------ what is served
    def _projections(self, kwargs: dict) -> dict[str, Projection] | None:
        """Each fused tensor's :class:`Projection` (its active adapter's factors), or None where this call
        must run PEFT's own forward."""
        if kwargs.get("adapter_names") is not None:
            return None
        inner, wrappers = unwrap_experts(self)
        if under_transformers_expert_parallel(inner):  # sentinel rows past the experts: PEFT's path
            return None
        lora: dict[str, LoraFactors] = {}
        for wrapper in wrappers:
            if wrapper.disable_adapters or wrapper.merged or wrapper.num_experts == 1:
                return None
            active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
            if len(active) > 1:
                return None
            if wrapper.get_param().dtype not in _COMPUTE_DTYPES:
                return None
            if active:
                lhs, rhs, scaling = lora_delta_factors(wrapper, active[0])
                lora[wrapper.parameter_name] = LoraFactors(lhs, rhs, scaling)
        layout = self.experts_layout
        projections = {}
        for name in (layout.up_name, "down_proj"):
            bias = getattr(inner, f"{name}_bias") if layout.has_bias else None
            projections[name] = Projection(getattr(inner, name), bias, lora.get(name), layout.weight_on_right)
        return projections

    # ------------------------------------------------------------------ the compute
    def _expert(self, inner: nn.Module, projections: dict[str, Projection], x: torch.Tensor,
                up_low_rank_in: torch.Tensor | None, expert: int) -> torch.Tensor:
        """Expert ``expert`` on its rows ``x``, whose up projection's ``x @ A_e`` is ``up_low_rank_in``."""
        layout = self.experts_layout
        hidden = projections[layout.up_name].per_expert(x, up_low_rank_in, expert)
        down = projections["down_proj"]
        hidden, down_low_rank_in = read_with_low_rank(
            lambda up_out: _gate(inner, layout, up_out), (hidden,),
            (lambda h: down.low_rank_in(h, expert)) if down.lora is not None else None)
        out = down.per_expert(hidden, down_low_rank_in, expert)
        return inner.post_expert_norm(out) if layout.has_post_expert_norm else out

    def _routed_tokens(self, inner: nn.Module, projections: dict[str, Projection], hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed call contract: the tokens ``hidden_states`` [T, H] are at hand."""
        return self._routed(inner, projections, RowSource.of(hidden_states), top_k_index, top_k_weights)

    def _routed(self, inner: nn.Module, projections: dict[str, Projection], hidden_states: RowSource,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``sum_j w_j * expert_{e_j}(x)`` for each token of ``hidden_states`` [T, H] (read where the up projection
        reads them: see :func:`read_with_low_rank`)."""
        if (experts_implementation(getattr(inner, "config", None)) == "grouped_mm"
                and not self.experts_layout.has_zero_experts
                and _grouped_kernel_available(hidden_states.device, hidden_states.dtype)):
            operands = {name: p.grouped_operands() for name, p in projections.items()}
            if _aligned(hidden_states.hidden_size, [t for ops in operands.values() for t in ops if t is not None]):
                return self._routed_grouped(inner, projections, operands, hidden_states, top_k_index, top_k_weights)
        return self._routed_per_expert(inner, projections, hidden_states, top_k_index, top_k_weights)

    def _routed_per_expert(self, inner: nn.Module, projections: dict[str, Projection], hidden_states: RowSource,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """As transformers' eager forward: experts in ascending order, each on its rows, then one index_add
        adding each token's rows in that order (the order the eager forward's per-expert index_add_ adds them)."""
        top_k = top_k_index.shape[-1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token = torch.div(order, top_k, rounding_mode="floor")
        num_slots = projections[self.experts_layout.up_name].weight.shape[0]
        # One host sync for the rows per expert (the eager forward syncs once per expert).
        counts = torch.bincount(flat_expert, minlength=num_slots).tolist()
        num_routed = getattr(inner, "num_routed_experts", None) if self.experts_layout.has_zero_experts else None
        computed = [(expert, count) for expert, count in enumerate(counts)
                    if count and (num_routed is None or expert < num_routed)]  # (not the identity experts)
        starts = [0, *itertools.accumulate(counts)]  # each expert's first row
        up = projections[self.experts_layout.up_name]

        def up_low_rank_in(rows: torch.Tensor) -> list[torch.Tensor]:
            return [up.low_rank_in(rows[starts[e]:starts[e] + n], e) for e, n in computed]

        gathered = hidden_states.gather(token)
        rows, low_rank_ins = read_with_low_rank(gathered.read, gathered.inputs,
                                                up_low_rank_in if up.lora is not None else None)
        low_rank_in_of = dict(zip([e for e, _ in computed], low_rank_ins or [None] * len(computed), strict=True))
        outputs = []
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            mine = rows[starts[expert]:starts[expert] + count]
            if expert not in low_rank_in_of:  # a zero-computation expert: the identity
                outputs.append(mine)
            else:
                outputs.append(self._expert(inner, projections, mine, low_rank_in_of[expert], expert))
        per_row = torch.cat(outputs) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return hidden_states.new_zeros().index_add(0, token, per_row.to(hidden_states.dtype))

    def _routed_grouped(self, inner: nn.Module, projections: dict[str, Projection], operands: dict,
                        hidden_states: RowSource, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """As transformers' grouped_mm forward: rows sorted by expert, one grouped GEMM per matrix (the
        LoRA branch's two rank-sized ones included), each token's rows summed in its top-k order."""
        layout = self.experts_layout
        num_tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        num_experts = projections[layout.up_name].weight.shape[0]
        offsets = torch.cumsum(torch.bincount(expert_ids, minlength=num_experts), dim=0, dtype=torch.int32)
        up, down = projections[layout.up_name], projections["down_proj"]
        up_ops, down_ops = operands[layout.up_name], operands["down_proj"]
        gathered = hidden_states.gather(perm // top_k)
        rows, rows_low_rank_in = read_with_low_rank(
            lambda *inputs: gathered.read(*inputs).to(up_ops[0].dtype), gathered.inputs,
            (lambda x: grouped_low_rank_in(x, offsets, up_ops)) if up.lora is not None else None)
        hidden = up.grouped(rows, rows_low_rank_in, offsets, expert_ids, up_ops)
        hidden, hidden_low_rank_in = read_with_low_rank(
            lambda up_out: _gate(inner, layout, up_out).to(down_ops[0].dtype), (hidden,),
            (lambda h: grouped_low_rank_in(h, offsets, down_ops)) if down.lora is not None else None)
        out = down.grouped(hidden, hidden_low_rank_in, offsets, expert_ids, down_ops)
        if layout.has_post_expert_norm:
            out = inner.post_expert_norm(out)
        weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        summed = weighted[inverse].view(num_tokens, top_k, -1).sum(dim=1)
        return summed.to(hidden_states.dtype)

    def _pre_routed(self, inner: nn.Module, projections: dict[str, Projection],
                    hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama-4: ``hidden_states`` [E*T, H] holds each expert's block of (score-scaled) tokens."""
        up, down = projections["gate_up_proj"], projections["down_proj"]
        per_expert = hidden_states.view(up.weight.shape[0], -1, hidden_states.shape[-1])
        # (The up projection's rows are the module's input itself, which A's gradient keeps: nothing to regather.)
        gate_up = up.batched(per_expert, up.batched_low_rank_in(per_expert) if up.lora is not None else None)
        hidden, low_rank_in = read_with_low_rank(lambda up_out: _gate(inner, self.experts_layout, up_out), (gate_up,),
                                                 down.batched_low_rank_in if down.lora is not None else None)
        out = down.batched(hidden, low_rank_in)
        return out.view(-1, out.shape[-1])

    def extra_repr(self) -> str:
        own = super().extra_repr()
        shown = "lora_experts: activations"
        return f"{own}, {shown}" if own else shown


def _gate(inner: nn.Module, layout: ExpertsLayout, hidden: torch.Tensor) -> torch.Tensor:
    """The family's gate on ``gate_up`` (its ``_apply_gate``: gpt-oss's interleaved, clamped one), or its
    activation for non-gated experts."""
    if not layout.gated:
        return inner.act_fn(hidden)
    apply_gate = experts_gate(inner)
    if apply_gate is not None:
        return apply_gate(hidden)
    gate, up = hidden.chunk(2, dim=-1)  # Llama-4 and LongCat-Flash: act(gate) * up
    return inner.act_fn(gate) * up


def _carries_lora(wrappers: list[nn.Module]) -> bool:
    return any(len(wrapper.lora_A) > 0 for wrapper in wrappers)


def compute_lora_on_activations(model: nn.Module) -> list[str]:
    """Make every experts module whose fused tensors carry PEFT LoRA compute it on the activations.

    Swaps the class of the outermost ``ParamWrapper`` (what the block calls) for a
    :class:`LoraOnActivationsExperts` subclass; call it before expert parallelism, whose class is then swapped
    on top. Idempotent. A model without LoRA on its experts, or whose experts' layout is unknown, is left
    as it is. Returns the names of the experts modules served.
    """
    served = []
    for name, module in model.named_modules():
        experts = getattr(module, EXPERTS_ATTR, None)
        if not isinstance(experts, nn.Module) or experts not in module.children():
            continue
        inner, wrappers = unwrap_experts(experts)
        if not wrappers or not _carries_lora(wrappers):
            continue
        layout = read_layout(inner)
        if layout is None:  # a layout we do not know: PEFT's path stays
            continue
        if not isinstance(experts, LoraOnActivationsExperts):
            experts.experts_layout = layout
            swap_class(experts, LoraOnActivationsExperts)
        served.append(f"{name}.{EXPERTS_ATTR}" if name else EXPERTS_ATTR)
    return served
