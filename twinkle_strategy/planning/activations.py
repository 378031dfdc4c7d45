"""Activations measured, not guessed: the model's own forward and backward traced on fake tensors.

For each kind of decoder layer (dense or MoE, full or linear attention ...) the model runs once with
one layer of each kind, and once more with that kind's layer twice: the difference is what one more
layer of that kind keeps for the backward. Scaled by the layer counts, plus the first run (embedding,
head, loss and the backward's transient peak), that is the step's activation peak. The run is real
model code at the recipe's micro-batch and length, with its activation checkpointing, under
FakeTensorMode (no storage) and torch's MemTracker, in this process, whatever the model's size.

What is not the model's own code: the experts' routing. A fake tensor has no values, so each rank's
experts get a balanced share of the rows (``routing_skew`` times it on the busiest EP rank), computed
expert by expert with the experts' own weights; EP's dispatch buffers (rows sent, rows received, the
return trip) are allocated as the all-to-alls allocate them. Each experts module becomes a
:class:`BalancedRoutingExperts` for this (its class swapped, as EP swaps it). LoRA on the fused experts
is computed as ``lora_experts`` computes it: on the activations (``x @ W_e + scale * (x @ A_e) @ B_e``, with
its :func:`~twinkle_strategy.moe.lora_experts.read_with_low_rank`: autograd keeps the rank-wide ``x @ A_e`` and
what the rows each LoRA'd projection reads are recomputed from in the backward: the tokens and the index,
under EP the tokens before the dispatch, whose all-to-all the backward makes again, and ``gate_up``; no
expert-sized tensor), or PEFT's way (``W + scale * B @ A`` formed for every local expert and kept to the backward). Gradients are dropped as soon as they are
accumulated, as FSDP2 frees them after its reduce-scatter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from twinkle_strategy.compat import torch_internals as th
from twinkle_strategy.config import LoraExperts
from twinkle_strategy.dtypes import FLOAT_DTYPES, kept_parameters, loaded_dtype
from twinkle_strategy.errors import ModelStructureError, PlanInputError
from twinkle_strategy.moe.class_swap import swap_class
from twinkle_strategy.moe.discovery import unwrap_experts
from twinkle_strategy.moe.dispatch import rows_travel_when_read
from twinkle_strategy.moe.expert_parallel import apply_expert_parallel
from twinkle_strategy.moe.lora_experts import read_with_low_rank
from twinkle_strategy.moe.recompute import apply_activation_checkpointing
from twinkle_strategy.moe.row_source import RowSource
from twinkle_strategy.planning.request import PlanRequest
from twinkle_strategy.planning.skeleton import PlannedModel


@dataclasses.dataclass(frozen=True)
class ActivationPeak:
    """The step's activation bytes on one rank (one micro-batch: accumulation frees each before the next)."""

    base: int  # one layer of each kind, with embedding, head, loss and backward transients
    per_layer: dict[str, int]  # one more layer of each kind
    layer_counts: dict[str, int]
    tokens: int  # tokens each rank computes per micro-batch

    @property
    def total(self) -> int:
        return self.base + sum(self.per_layer[k] * (self.layer_counts[k] - 1) for k in self.per_layer)


def layer_kind(layer: nn.Module) -> str:
    """Layers of one kind keep the same activations: same classes of parts, same attention type."""
    parts = ",".join(type(m).__name__ for m in layer.children())
    return f"{type(layer).__name__}({parts}){getattr(layer, 'layer_type', '') or ''}"


def measure_activations(planned: PlannedModel, request: PlanRequest, *, gathered_in_backward: int = 0) -> ActivationPeak:
    """Trace the step's activations (mutates ``planned.model``: measure the states before).

    ``gathered_in_backward``: bytes FSDP2 holds while each layer's backward runs (the layer unsharded and
    the one it prefetches), held in the trace from a layer's output gradient to its input gradient: the
    peak is then the larger of the backward's start and a layer's backward, with what each really holds.
    """
    model, dims = planned.model, planned.dims
    tokens = math.ceil(request.max_length / dims.sp_size)
    kinds: dict[str, list[nn.Module]] = {}
    for layer in planned.layers:
        kinds.setdefault(layer_kind(layer), []).append(layer)
    holder, attr = _layer_list(model, planned.layers)
    firsts = [layers[0] for layers in kinds.values()]
    setattr(holder, attr, nn.ModuleList(firsts))  # only the layers traced are made fake and cut (seconds for 61)
    mode = th.fake_tensor_mode()
    _to_fake(model, request, mode)
    if dims.ep_enabled:
        apply_expert_parallel(model, dims, 0, ep_group=None)  # this rank's slice of the experts, as the run cuts
    for block in planned.blocks:
        block.experts.balanced_routing = BalancedRouting(ep_size=dims.ep_size, skew=request.routing_skew,
                                                         lora_experts=LoraExperts(request.strategy.lora_experts))
        swap_class(block.experts, BalancedRoutingExperts)
    if request.gradient_checkpointing:
        apply_activation_checkpointing(planned.layers)
    slot: list = []  # the holding call and its bytes, one for every layer: their backwards run one after another
    hooks = [_holding_during_backward(layer, gathered_in_backward, mode, slot) for layer in planned.layers] \
        if gathered_in_backward else []
    vocab = getattr(planned.config.get_text_config(), "vocab_size", 2)

    def trace(layers: list[nn.Module]) -> int:
        setattr(holder, attr, nn.ModuleList(layers))
        slot.clear()  # (the last trace's first layer kept its bytes to its end)
        with mode:
            ids = torch.randint(0, vocab, (request.micro_batch, tokens))
            return th.peak_tracked_bytes(lambda: _forward_backward(model, ids))

    try:
        with _dropping_grads(model):
            base = trace(firsts)
            per_layer = {kind: trace(firsts + [firsts[i]]) - base for i, kind in enumerate(kinds)}
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # the model's own code refused the step
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanInputError(f"the model's forward and backward failed on fake tensors, as the run would fail "
                             f"({type(exc).__name__}: {first_line}); check the LoRA targets and sizes") from exc
    finally:
        for hook in hooks:
            hook.remove()
    return ActivationPeak(base=base, per_layer={k: max(v, 0) for k, v in per_layer.items()},
                          layer_counts={k: len(v) for k, v in kinds.items()}, tokens=request.micro_batch * tokens)


def _forward_backward(model: nn.Module, ids: torch.Tensor) -> None:
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()


def _holding_during_backward(layer: nn.Module, nbytes: int, mode, slot: list):
    """A forward hook making ``layer``'s backward hold ``nbytes`` (FSDP2's gathered units) while it runs.

    The bytes are taken when the gradient of the layer's output arrives (FSDP2's pre-backward unshard) and
    given back when its input's gradient is complete (its post-backward reshard); an input that needs no
    gradient (the first layer's, under LoRA) keeps them to the end of the backward, whose rest is smaller.
    ``slot`` is shared by every layer: one layer's output is the next one's input, and its hooks may run
    in either order; the next layer's bytes replace the last's, never add to them (nor are freed by it).
    """

    def hook(module, args, kwargs, output):
        call = object()  # this call's bytes (a layer traced twice is two calls)

        def take(grad):
            slot[:] = [call]
            with mode:
                slot.append(torch.empty(nbytes, dtype=torch.uint8))
            return grad

        def give_back(grad):
            if slot and slot[0] is call:  # (not the next layer's, taken just before on the same tensor)
                slot.clear()
            return grad

        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(take)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(give_back)
        return output

    return layer.register_forward_hook(hook, with_kwargs=True)


def _layer_list(model: nn.Module, layers: list[nn.Module]) -> tuple[nn.Module, str]:
    """The module and attribute holding the decoder layers (a ModuleList the model's forward loops over)."""
    first = layers[0]
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and any(m is first for m in child):
                return module, name
    raise ModelStructureError(f"{type(model).__name__}: no ModuleList holds its decoder layers; the plan cannot trace it")


def _to_fake(model: nn.Module, request: PlanRequest, mode) -> None:
    """Every parameter and buffer a fake CPU tensor in the dtype it computes in (FSDP2's gathered copy)."""
    loaded = loaded_dtype(model)
    mixed = request.strategy.mixed_precision
    compute = loaded if mixed == "no" else FLOAT_DTYPES[mixed]
    kept = kept_parameters(model, compute)
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        params, buffers = th.parameter_slots(module), th.buffer_slots(module)
        for key, param in list(params.items()):
            if param is None:
                continue
            if id(param) not in done:
                dtype = param.dtype if (id(param) in kept or mixed == "no" or not param.is_floating_point()) \
                    else compute
                with mode:
                    done[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="cpu"),
                                                   requires_grad=param.requires_grad)
            params[key] = done[id(param)]
        for key, buf in list(buffers.items()):
            if buf is not None:
                with mode:
                    buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype, device="cpu")


@contextlib.contextmanager
def _dropping_grads(model: nn.Module):
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None  # FSDP2 reduce-scatters the gathered gradient and frees it; the shard is counted apart


@dataclasses.dataclass(frozen=True)
class BalancedRouting:
    ep_size: int
    skew: float  # the busiest EP rank's rows, as a multiple of a balanced share
    lora_experts: LoraExperts = LoraExperts.ACTIVATIONS  # how LoRA on the fused experts is computed


@dataclasses.dataclass(frozen=True)
class ExpertLowRank:
    """One adapter of one fused expert parameter, as PEFT's ``ParamWrapper`` stores it: ``lora_A`` [E*r, in]
    (expert blocks of r rows) and ``lora_B`` [out, r*E] (the expert index fastest)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    num_experts: int  # expert slots of the wrapped parameter on this rank (PEFT's reshape)
    scale: float

    def factors(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_e [r, in], B_e [out, r]): views of the adapters, cast to the compute dtype where kept in another."""
        a = self.lora_a.reshape(self.num_experts, -1, self.lora_a.shape[-1])[expert].to(dtype)
        b = self.lora_b.reshape(self.lora_b.shape[0], -1, self.num_experts)[:, :, expert].to(dtype)
        return a, b

    def low_rank_in(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x @ A_e`` [rows, r]: kept for B's gradient (rank-sized)."""
        return F.linear(x, self.factors(expert, x.dtype)[0])

    def project(self, low_rank_in: torch.Tensor, expert: int) -> torch.Tensor:
        """``scale * (x @ A_e) @ B_e`` from :meth:`low_rank_in`; nothing expert-sized is kept."""
        return F.linear(low_rank_in, self.factors(expert, low_rank_in.dtype)[1]) * self.scale


class BalancedRoutingExperts(nn.Module):
    """Mixin for an experts module whose forward routes balanced, with EP's dispatch buffers (see the module
    docstring). Never instantiated: ``measure_activations`` puts it in front of the module's own class."""

    balanced_routing: BalancedRouting

    def forward(self, hidden_states, top_k_index, top_k_weights):
        ep_size, skew = self.balanced_routing.ep_size, self.balanced_routing.skew
        inner, wrappers = unwrap_experts(self)
        form_sums = self.balanced_routing.lora_experts == LoraExperts.PEFT

        def weight(attr: str) -> tuple[torch.Tensor, list[ExpertLowRank]]:
            """The expert stack ``attr`` computes with, and its adapters still to apply to the activations."""
            value, low_ranks = getattr(inner, attr), []
            for wrapper in wrappers:
                if getattr(wrapper, "parameter_name", None) == attr:
                    for adapter in wrapper.lora_A:
                        if form_sums:  # PEFT's path: W + BA, the expert stack's size, kept to the backward
                            value = value + wrapper.get_delta_weight(adapter)
                        else:
                            low_ranks.append(ExpertLowRank(
                                lora_a=wrapper.lora_A[adapter].weight, lora_b=wrapper.lora_B[adapter].weight,
                                num_experts=wrapper.num_experts, scale=wrapper.scaling[adapter]))
            return value, low_ranks

        tokens, top_k = top_k_index.shape
        rows = tokens * top_k
        token_of_row = torch.arange(rows, device=hidden_states.device) // top_k
        received = math.ceil(rows * skew) if ep_size > 1 else rows
        # The rows the local experts read, read as lora_experts reads them (a RowSource): without EP the tokens,
        # each top_k times; with EP the rows sent (one per (token, choice)), the all-to-all's output buffer, and
        # that gathered in expert order as lora_experts sorts it. The rows travel when read, so LoRA's region
        # keeps the tokens and sends the rows again in the backward; inside a checkpointed layer, whose record
        # keeps the rows received, they are at hand (the all-to-all's output buffer, kept).
        if ep_size == 1:
            source = RowSource.of(hidden_states).gather(token_of_row)
        else:
            buffer = torch.arange(received, device=hidden_states.device) % rows  # sent row of each received row
            if rows_travel_when_read():
                source = RowSource.of(hidden_states).gather(token_of_row).gather(buffer)
            else:
                source = RowSource.of(hidden_states[token_of_row][buffer])
            source = source.gather(torch.arange(received, device=hidden_states.device))
        gated = hasattr(inner, "gate_up_proj")
        gate_up, gate_up_lora = weight("gate_up_proj" if gated else "up_proj")
        down, down_lora = weight("down_proj")
        act = getattr(inner, "act_fn", F.silu)
        local = gate_up.shape[0]
        sizes = [received // local + (1 if e < received % local else 0) for e in range(local)]

        def gate(h: torch.Tensor) -> torch.Tensor:
            if gated:
                g, u = h.chunk(2, dim=-1)
                return act(g) * u
            return act(h)

        def low_rank_ins(adapters: list[ExpertLowRank], expert: int | None = None):
            """Each adapter's ``x @ A_e``, per expert of ``sizes`` (``expert`` None) or for ``expert``."""
            if not adapters:
                return None
            if expert is not None:
                return lambda h: [a.low_rank_in(h, expert) for a in adapters]
            return lambda x: [[a.low_rank_in(chunk, e) for a in adapters] for e, chunk in enumerate(x.split(sizes))]

        # As lora_experts computes it (its read_with_low_rank): LoRA-A's input is not kept but recomputed in the
        # backward, from the module's input and the index (the up projection) and from gate_up (the down one).
        x, up_ins = read_with_low_rank(source.read, source.inputs, low_rank_ins(gate_up_lora))
        outs = []
        for e, chunk in enumerate(x.split(sizes)):
            h = _project(chunk, gate_up[e])
            for adapter, low_rank_in in zip(gate_up_lora, up_ins[e] if up_ins else [], strict=True):
                h = h + adapter.project(low_rank_in, e)
            h, down_ins = read_with_low_rank(gate, (h,), low_rank_ins(down_lora, e))
            out = _project(h, down[e])
            for adapter, low_rank_in in zip(down_lora, down_ins or [], strict=True):
                out = out + adapter.project(low_rank_in, e)
            outs.append(out)
        y = torch.cat(outs)
        if ep_size > 1:
            y = y[torch.arange(rows, device=y.device) % received]  # the return trip's buffer
        weighted = (y * top_k_weights.reshape(-1, 1)).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of_row, weighted)


def _project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` through one expert's weight, stored [out, in] (most families) or [in, out] (gpt-oss)."""
    return F.linear(x, w) if w.shape[-1] == x.shape[-1] else x @ w
