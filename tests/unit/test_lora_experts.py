"""LoRA on fused experts computed on the activations (twinkle_strategy/moe/lora_experts.py), in one process.

Against PEFT's own path (W + BA formed): every family of the matrices, fp32 losses and gradients within 1e-5,
in each experts implementation a family offers (grouped_mm, eager); bf16 with the same first-layer routing.
W + BA is never kept for the backward (a saved-tensors hook, red on PEFT's path). What it cannot serve runs
PEFT's own forward (bit-equal). The adapter saved is PEFT's and loads into plain PEFT.
"""

from __future__ import annotations

import collections

import pytest
import torch
from lora_experts_cases import with_expert_lora
from safetensors.torch import load_file

from twinkle_strategy.moe.discovery import unwrap_experts
from twinkle_strategy.moe.lora_experts import LoraOnActivationsExperts, compute_lora_on_activations
from twinkle_strategy.testing.families import FAMILIES, MATRIX_FAMILIES
from twinkle_strategy.testing.tiny_models import build_tiny_model

ALL_FAMILIES = tuple(dict.fromkeys(MATRIX_FAMILIES + FAMILIES))
# transformers dispatches these families' experts (@use_experts_implementation): grouped_mm by default, eager too.
# Llama-4 (pre-routed, batched) and LongCat-Flash (zero-computation experts) have their own eager forward only.
UNDECORATED = ("llama4", "longcat_flash")
CASES = [(f, impl) for f in ALL_FAMILIES for impl in (("eager",) if f in UNDECORATED else ("grouped_mm", "eager"))]


def lora_model(family: str, implementation: str, *, activations: bool, dtype=torch.float32, **lora_options):
    model = build_tiny_model(family, dtype=dtype)
    if family not in UNDECORATED:
        model.set_experts_implementation(implementation)
    model = with_expert_lora(model, **lora_options)
    if activations:
        assert compute_lora_on_activations(model), f"{family}: no experts module served"
    return model


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def grouped_mm_nodes(loss: torch.Tensor) -> int:
    """How many grouped GEMMs the backward graph of ``loss`` holds."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "GroupedMm" in type(node).__name__
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize(("family", "implementation"), CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_fp32_losses_and_gradients_match_peft(family, implementation):
    ids = batch()
    reference = lora_model(family, implementation, activations=False)
    ours = lora_model(family, implementation, activations=True)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    loss, grads = loss_and_grads(ours, ids)
    assert abs(float(loss - ref_loss)) <= 1e-5, f"{family}: loss {float(loss)} vs {float(ref_loss)}"
    assert grads.keys() == ref_grads.keys()
    assert any(".experts." in n and "lora_" in n for n in grads), f"{family}: no expert LoRA gradient"
    for name, ref in ref_grads.items():
        diff = float((grads[name] - ref).abs().max())
        assert diff <= 1e-5 * max(1.0, float(ref.abs().max())), f"{family}: {name} gradient differs by {diff}"
    if implementation == "grouped_mm":  # the base GEMM and the LoRA branch's two, per projection
        # more grouped GEMMs than PEFT's path (one per projection): the LoRA branch's own, rank-sized ones
        assert grouped_mm_nodes(loss_graph(ours, ids)) > grouped_mm_nodes(loss_graph(reference, ids)) > 0
    else:
        assert grouped_mm_nodes(loss_graph(ours, ids)) == 0


def loss_graph(model, ids) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def saved_stacks(model, ids) -> list[tuple[int, ...]]:
    """Shapes of the tensors one forward saves for the backward that are an expert stack (a fused expert
    tensor's size and an expert's slice of it, or the whole) but no parameter's storage: a formed W + BA."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stacks = [p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3 and "lora_" not in n]
    stack_bytes = {p.numel() * p.element_size() for p in stacks}
    slices = {tuple(sorted(p.shape[1:])) for p in stacks}
    found = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.nbytes() in stack_bytes and storage.data_ptr() not in params and \
                tuple(sorted(t.shape[-2:])) in slices:
            found.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return found


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4", "longcat_flash", "nemotron_h"])
def test_w_plus_ba_is_never_kept_for_the_backward(family):
    implementation = "eager" if family in UNDECORATED else "grouped_mm"
    ids = batch()
    assert saved_stacks(lora_model(family, implementation, activations=True), ids) == []
    # PEFT's own path keeps the formed W + BA of every experts tensor (what this test exists to catch).
    assert saved_stacks(lora_model(family, implementation, activations=False), ids) != []


def saved_row_sized(model, ids) -> collections.Counter:
    """How many tensors one forward saves for the backward that are whole tensors of the routed rows' size
    [T*k, H] or the down projection's input's [T*k, I] (a view of a larger tensor, as the gate's halves of
    ``gate_up``, is that tensor's, not one of these)."""
    config = model.config.get_text_config()
    rows = ids.numel() * config.num_experts_per_tok
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    sizes = {(rows, config.hidden_size): "rows [T*k, H]", (rows, inter): "h [T*k, I]"}
    found: dict[int, str] = {}

    def pack(t: torch.Tensor):
        name = sizes.get(tuple(t.shape))
        if name is not None and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            found[t.untyped_storage().data_ptr()] = name
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return collections.Counter(found.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_keeps_no_routed_rows_nor_down_input(family):
    """A's gradient needs the rows each projection reads, but they are recomputed in the backward (a gather of
    the layer's tokens, the gate of ``gate_up``): the forward keeps no more row-sized tensors than with LoRA on
    attention only (where the frozen experts keep none of their inputs). On the grouped path, whose combine is
    transformers' grouped_mm forward's (the per-expert path concatenates its outputs where transformers' eager
    forward adds them expert by expert: another count of output rows, not of inputs; it regathers the same)."""
    implementation = "grouped_mm"
    ids = batch()
    # (An intermediate size that is neither hidden / 2 nor hidden: each of the sizes is its own tensors' only.)
    sizes = {"moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size": 24}
    kept = {}
    for name, targets in (("attention only", []), ("with experts", None)):
        model = build_tiny_model(family, **sizes)
        model.set_experts_implementation(implementation)
        model = with_expert_lora(model, **({} if targets is None else {"target_parameters": targets}))
        if targets is None:
            assert compute_lora_on_activations(model)
        kept[name] = saved_row_sized(model, ids)
    with_experts, attention_only = kept["with experts"], kept["attention only"]
    assert with_experts <= attention_only, (with_experts, attention_only)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4", "nemotron_h", "longcat_flash", "mixtral"])
def test_bf16_routes_the_same_and_loses_nearly_the_same(family):
    """bf16: PEFT rounds W + s*BA to bf16 once per weight, ours rounds x@W and s*(x@A)@B apart: either is a
    relative error of up to 2^-8 per GEMM output, different roundings, not different math. Through two layers
    and the lm_head they move the bf16 logits by about an ulp, and the loss by at most a couple of bf16 ulps
    of its own size (2^-7 relative each; measured: 1e-6 to 6e-3 relative over the families, Mixtral the most).
    The tolerance is two such ulps; a wrong expert's slice of the adapter moves the loss by far more. The
    routing of the first layer (its input untouched by expert LoRA) must be identical."""
    ids = batch()
    losses, routes = [], []
    for activations in (False, True):
        model = lora_model(family, "eager" if family in UNDECORATED else "grouped_mm", activations=activations,
                           dtype=torch.bfloat16)
        first = next(m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module))
        seen: list = []
        # The block's call: (hidden_states, top_k_index, top_k_weights), or Llama-4's (routed_in,).
        handle = first.experts.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[1:] or args))
        loss, _ = loss_and_grads(model, ids)
        handle.remove()
        losses.append(float(loss))
        routes.append(seen[0])
    assert all(torch.equal(a, b) for a, b in zip(*routes, strict=True)), f"{family}: first-layer routing differs"
    two_ulps = 2 * 2**-7 * abs(losses[0])
    assert abs(losses[1] - losses[0]) <= two_ulps, f"{family}: bf16 loss {losses[1]} vs {losses[0]}"


def test_what_it_cannot_serve_runs_peft_own_forward():
    """Two active adapters, adapters disabled, adapters merged: PEFT's forward, so bit-equal to PEFT's path."""
    ids = batch()
    from peft import LoraConfig

    models = [lora_model("qwen3_moe", "grouped_mm", activations=a) for a in (False, True)]
    for model in models:
        torch.manual_seed(11)
        model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], init_lora_weights=False,
                                               target_parameters=model.peft_config["default"].target_parameters))
        model.eval()

    def both(run):
        return [run(model) for model in models]

    for model in models:
        model.base_model.set_adapter(["default", "second"])
    two = both(lambda m: m(input_ids=ids).logits)
    assert torch.equal(*two)

    def disabled(model):
        with model.disable_adapter():
            return model(input_ids=ids).logits

    assert torch.equal(*both(disabled))
    for model in models:
        model.base_model.set_adapter("default")
        model.merge_adapter()
    merged = both(lambda m: m(input_ids=ids).logits)
    assert torch.equal(*merged)
    for model in models:
        model.unmerge_adapter()
    served = both(lambda m: m(input_ids=ids).logits)
    assert not torch.equal(*served)  # one adapter, unmerged: ours (other summation order), no longer PEFT's
    assert torch.allclose(*served, atol=1e-5)


def test_use_rslora_scaling_is_peft_own():
    ids = batch()
    reference = lora_model("mixtral", "grouped_mm", activations=False, use_rslora=True, r=4, lora_alpha=8)
    ours = lora_model("mixtral", "grouped_mm", activations=True, use_rslora=True, r=4, lora_alpha=8)
    assert abs(float(loss_and_grads(ours, ids)[0] - loss_and_grads(reference, ids)[0])) <= 1e-5
    wrapper = next(m for m in ours.modules() if isinstance(m, LoraOnActivationsExperts))
    assert wrapper.scaling["default"] == pytest.approx(8 / 4 ** 0.5)


def test_dropout_on_experts_is_still_refused():
    with pytest.raises(ValueError, match="lora_dropout"):
        lora_model("qwen3_moe", "grouped_mm", activations=False, lora_dropout=0.1)


def test_a_model_without_lora_on_experts_is_untouched():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model("qwen3_moe"), LoraConfig(r=2, target_modules=["o_proj"]))
    classes = [type(m) for m in model.modules()]
    assert compute_lora_on_activations(model) == []
    assert compute_lora_on_activations(build_tiny_model("qwen3_moe")) == []
    assert [type(m) for m in model.modules()] == classes


def test_an_experts_subclass_with_its_own_forward_keeps_peft_path():
    """It inherits @use_experts_implementation's attributes, not their meaning: left to PEFT's path."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class HalvedExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) / 2

    model = build_tiny_model("qwen3_moe")
    for module in model.modules():
        if isinstance(module, Qwen3MoeExperts):
            module.__class__ = HalvedExperts
    model = with_expert_lora(model)
    assert compute_lora_on_activations(model) == []
    assert not any(isinstance(m, LoraOnActivationsExperts) for m in model.modules())


def test_the_swap_keeps_names_and_is_idempotent():
    model = lora_model("gpt_oss", "grouped_mm", activations=False)
    names = [n for n, _ in model.named_parameters()]
    served = compute_lora_on_activations(model)
    assert served == compute_lora_on_activations(model)  # idempotent
    assert [n for n, _ in model.named_parameters()] == names
    experts = model.get_submodule(served[0])
    inner, wrappers = unwrap_experts(experts)
    assert isinstance(experts, LoraOnActivationsExperts) and wrappers[0] is experts
    assert not any(isinstance(w, LoraOnActivationsExperts) for w in wrappers[1:])  # only the outermost
    assert "lora_experts: activations" in repr(experts)


def test_saved_adapter_is_peft_own_and_loads_into_plain_peft(tmp_path):
    """The same steps on both paths save the same adapter files (same keys, shapes, dtypes; values within the
    steps' rounding), and plain PEFT loads ours onto a fresh model to our logits, merged too."""
    from peft import PeftModel

    ids = batch()
    saved = {}
    for activations in (False, True):
        model = lora_model("qwen3_moe", "grouped_mm", activations=activations)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(2):
            loss_and_grads(model, batch(step))
            optimizer.step()
            optimizer.zero_grad()
        out = tmp_path / ("ours" if activations else "peft")
        model.save_pretrained(out)
        saved[activations] = load_file(out / "adapter_model.safetensors")
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    ours, peft = saved[True], saved[False]
    assert ours.keys() == peft.keys() and any(".experts." in k for k in ours)
    for key in ours:
        assert ours[key].shape == peft[key].shape and ours[key].dtype == peft[key].dtype, key
        assert torch.allclose(ours[key], peft[key], atol=1e-6), key
    loaded = PeftModel.from_pretrained(build_tiny_model("qwen3_moe"), tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, logits, atol=1e-5)
        assert torch.allclose(loaded.merge_and_unload()(input_ids=ids).logits, logits, atol=1e-5)
