"""The internals of transformers, accelerate and torch that twinkle_strategy relies on, one fast check each.

Every internal is declared once, in :mod:`twinkle_strategy.compat`, with the one wrapper that
reads it. Here each gets a single-process check of exactly the behaviour the library relies on,
on tiny real models. A release that removes or changes one fails its check with a message that
names the internal, the installed version and what the library uses it for; then update its
wrapper (and its "checked on" versions), or declare the release unsupported.

The last tests hold the rule that makes this the one home: no module of the package outside
``compat/`` touches a private name of another library (see :func:`private_uses`).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import inspect
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from twinkle_strategy.compat import internals
from twinkle_strategy.compat import torch_internals as th
from twinkle_strategy.compat import transformers_internals as hf
from twinkle_strategy.compat import trl_internals as trl_steps
from twinkle_strategy.compat.transformers_internals import rule_class
from twinkle_strategy.errors import InternalChangedError

PACKAGE = Path(__file__).resolve().parents[2] / "twinkle_strategy"
INTERNALS = internals()
CHECKS = {}


def checks(*names):
    """Register the decorated function as the check of the internals ``names``."""
    def register(function):
        for name in names:
            assert name not in CHECKS, f"two checks for {name}"
            CHECKS[name] = function
        return function
    return register


class Tiny:
    """Tiny real models, built once per module; ``fresh`` ones for checks that change them."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cache  # noqa: B019 - one fixture object per test session, kept on purpose
    def model(self, family: str):
        return self.fresh(family)

    def fresh(self, family: str):
        from twinkle_strategy.testing.tiny_models import build_tiny_model

        return build_tiny_model(family)

    @functools.cached_property
    def loaded(self):
        """The tiny Qwen3-MoE, saved in its hub layout (per-expert keys) and loaded by ``from_pretrained``."""
        from transformers import AutoModelForCausalLM

        from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

        save_tiny_checkpoint("qwen3_moe", str(self.root / "qwen3_moe"))
        return AutoModelForCausalLM.from_pretrained(str(self.root / "qwen3_moe"), dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("internals"))


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda internal: internal.name)
def test_internal_behaves_as_relied_on(internal, tiny):
    failure = None
    try:
        CHECKS[internal.name](tiny)
    except InternalChangedError as exc:  # a wrapper found it gone: its message says all
        failure = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure of a check is the internal's change
        failure = (f"{internal.owner} {internal.installed_version()}: {internal.name} no longer behaves as relied "
                   f"on ({type(exc).__name__}: {exc}); {internal.summary()}. Update its wrapper in "
                   f"twinkle_strategy/compat/ and the versions it was checked on, or bound the supported range")
    if failure is not None:  # (outside the except: no traceback of the check, just what changed)
        pytest.fail(failure, pytrace=False)


def test_every_internal_has_a_check_and_a_wrapper():
    names = [internal.name for internal in INTERNALS]
    assert len(names) == len(set(names)) and len(names) > 20
    assert set(CHECKS) == set(names), f"without a check: {sorted(set(names) - set(CHECKS))}; " \
                                      f"checks of nothing declared: {sorted(set(CHECKS) - set(names))}"
    for internal in INTERNALS:
        assert internal.wrappers, f"{internal.name} has no wrapper"
        for name in internal.wrappers:
            module = {"torch": th, "trl": trl_steps}.get(internal.owner, hf)
            doc = getattr(module, name).__doc__
            assert internal.checked in doc and internal.replacement in doc, (name, doc)


# ------------------------------------------------------------------ transformers: dtypes
@checks("PreTrainedModel._get_dtype_plan")
def _dtype_plan(tiny):
    deepseek = tiny.model("deepseek_v3")
    plan = hf.dtype_plan(deepseek, torch.bfloat16)
    assert plan.get("e_score_correction_bias") == torch.float32, plan  # DeepSeek-V3's router bias
    assert hf.dtype_plan(deepseek, torch.float32) == {}
    from twinkle_strategy.dtypes import kept_dtypes

    assert kept_dtypes(deepseek, torch.bfloat16)["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32


@checks("PreTrainedModel._keep_in_fp32_modules_strict")
def _keep_in_fp32_strict(tiny):
    assert "e_score_correction_bias" in hf.keep_in_fp32_strict(tiny.model("deepseek_v3"))
    assert isinstance(hf.keep_in_fp32_strict(tiny.model("qwen3_moe")), set)


@checks("core_model_loading.build_glob_alternation")
def _glob_alternation(tiny):
    alternation, glob_of_group = hf.glob_alternation(["e_score_correction_bias", "layers.*.norm"])
    match = alternation.search("model.layers.1.mlp.gate.e_score_correction_bias")
    assert glob_of_group[match.lastgroup] == "e_score_correction_bias"
    assert glob_of_group[alternation.search("model.layers.3.post_attention_layernorm.weight").lastgroup] == \
        "layers.*.norm"
    assert alternation.search("model.embed_tokens.weight") is None


# ------------------------------------------------------------------ transformers: checkpoint layouts
def _expert_rules(model):
    """Qwen3-MoE's rule making ``gate_up_proj`` [E, 2I, H] from per-expert gate and up weights, and its sizes."""
    converter = rule_class("WeightConverter")
    rule = next(r for r in hf.conversion_rules(model) if isinstance(r, converter)
                and r.target_patterns == ["mlp.experts.gate_up_proj"])
    config = model.config
    return rule, config.num_experts, config.moe_intermediate_size, config.hidden_size


@checks("conversion_mapping.get_model_conversion_mapping")
def _conversion_mapping(tiny):
    rule, *_ = _expert_rules(tiny.model("qwen3_moe"))
    assert rule.source_patterns == ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]
    assert type(rule.operations[0]).__name__ == "MergeModulelist" and rule.operations[0].dim == 0


@checks("core_model_loading.WeightRenaming")
def _weight_renaming(tiny):
    renaming = rule_class("WeightRenaming")
    assert renaming(r"^backbone\.", "model.").rename_source_key("backbone.norm.weight")[0] == "model.norm.weight"
    assert renaming("a.weight", "b.weight").rename_source_key("a.weight")[0] == "b.weight"  # as layout builds them


@checks("core_model_loading.WeightConverter")
def _weight_converter(tiny):
    rule, *_ = _expert_rules(tiny.model("qwen3_moe"))
    assert isinstance(rule, rule_class("WeightConverter")) and not rule.was_used()
    reverse = rule.reverse_transform()
    assert reverse.source_patterns == rule.target_patterns and reverse.target_patterns == rule.source_patterns


@checks("core_model_loading.PrefixChange")
def _prefix_change(tiny):
    assert issubclass(rule_class("PrefixChange"), rule_class("WeightRenaming"))


@checks("core_model_loading.MergeModulelist")
def _merge_module_list(tiny):
    """Per-expert keys are stacked on dim 0: experts a..b-1 alone give rows [a, b) of the fused tensor."""
    from twinkle_strategy.checkpoint.conversions import convert_pieces

    model = tiny.model("qwen3_moe")
    rule, experts, inter, hidden = _expert_rules(model)
    target = "model.layers.0.mlp.experts.gate_up_proj"
    gate, up = torch.randn(experts, inter, hidden), torch.randn(experts, inter, hidden)

    def convert(first, last):
        pieces = {pattern: [(f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight", values[e])
                            for e in range(first, last)]
                  for pattern, proj, values in zip(rule.source_patterns, ("gate", "up"), (gate, up), strict=True)}
        shapes = {target: ((last - first, 2 * inter, hidden), torch.float32)}
        return convert_pieces(rule, target, pieces, config=model.config, shapes=shapes)[target]

    whole = convert(0, experts)
    assert whole.shape == (experts, 2 * inter, hidden) and torch.equal(whole[3], torch.cat([gate[3], up[3]]))
    assert torch.equal(convert(2, 5), whole[2:5])


@checks("core_model_loading.SplitModulelist")
def _split_module_list(tiny):
    rule, *_ = _expert_rules(tiny.model("qwen3_moe"))
    last = rule.reverse_transform().operations[-1]
    assert isinstance(last, rule_class("SplitModulelist")) and last.dim == 0


def _rows_commute(op, inputs: dict, source_patterns, target_patterns, shapes=None):
    """``op`` gives rows [1, 3) of its output from rows [1, 3) of its inputs (as layout reads them)."""
    from twinkle_strategy.checkpoint.conversions import ShapeOnlyModel

    def run(rows):
        model = ShapeOnlyModel(None, shapes or {}, None if rows is None else rows[1] - rows[0])
        given = {k: [t if rows is None else t[rows[0]:rows[1]] for t in v] for k, v in inputs.items()}
        out = op.convert(given, source_patterns=source_patterns, target_patterns=target_patterns,
                         full_layer_name="layer.first", model=model, config=None)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    whole, part = run(None), run((1, 3))
    assert whole.keys() == part.keys() and all(torch.equal(whole[k][1:3], part[k]) for k in whole), op
    return {k: tuple(v.shape) for k, v in whole.items()}


@checks("core_model_loading.Concatenate")
def _concatenate(tiny):
    op = rule_class("Concatenate")(dim=1)
    assert op.dim == 1
    assert _rows_commute(op, {"a": [torch.randn(4, 6)], "b": [torch.randn(4, 2)]}, ["a", "b"], ["t"]) == \
        {"t": (4, 8)}


@checks("core_model_loading.Chunk")
def _chunk(tiny):
    op = rule_class("Chunk")(dim=1)
    assert op.dim == 1
    assert _rows_commute(op, {"t": [torch.randn(4, 6)]}, ["t"], ["a", "b"]) == {"a": (4, 3), "b": (4, 3)}


@checks("core_model_loading.Split")
def _split(tiny):
    split = rule_class("Split", optional=True)
    if split is None:  # newer than the installed version: layout then never meets one
        assert importlib.metadata.version("transformers") < "5.23"
        return
    shapes = {"layer.first": ((4, 2), torch.float32), "layer.second": ((4, 4), torch.float32)}
    assert split(dim=1).dim == 1
    assert _rows_commute(split(dim=1), {"t": [torch.randn(4, 6)]}, ["t"], ["first", "second"], shapes) == \
        {"first": (4, 2), "second": (4, 4)}


@checks("core_model_loading.Interleave")
def _interleave(tiny):
    op = rule_class("Interleave")(dim=1)
    assert op.dim == 1
    assert _rows_commute(op, {"t": [torch.randn(4, 6)]}, ["t"], ["t"]) == {"t": (4, 6)}


@checks("core_model_loading.Transpose")
def _transpose(tiny):
    op = rule_class("Transpose")(dim0=1, dim1=2)
    assert (op.dim0, op.dim1) == (1, 2)
    shapes = {"layer.first": ((4, 5, 3), torch.float32)}
    assert _rows_commute(op, {"t": [torch.randn(4, 3, 5)]}, ["t"], ["t"], shapes) == {"t": (4, 5, 3)}


@checks("core_model_loading.dot_natural_key")
def _natural_order(tiny):
    assert hf.natural_order(["e.10.w", "e.2.w", "e.1.w", "a"]) == ["a", "e.1.w", "e.2.w", "e.10.w"]


@checks("core_model_loading.rename_source_key")
def _rename_source_key(tiny):
    model = tiny.model("qwen3_moe")
    rules = hf.conversion_rules(model)
    renamings = [r for r in rules if isinstance(r, rule_class("WeightRenaming"))]
    converters = [r for r in rules if isinstance(r, rule_class("WeightConverter"))]
    present = model.state_dict()
    target, pattern = hf.rename_source_key("model.layers.0.mlp.experts.3.gate_proj.weight", renamings, converters,
                                           model.base_model_prefix, present)
    assert target == "model.layers.0.mlp.experts.gate_up_proj" and pattern == "mlp.experts.*.gate_proj.weight"
    assert hf.rename_source_key("model.embed_tokens.weight", renamings, converters, model.base_model_prefix,
                                present) == ("model.embed_tokens.weight", None)


@checks("core_model_loading.revert_weight_conversion")
def _revert_weight_conversion(tiny):
    """Saving gives the per-expert keys back, each expert's gate and up halves."""
    model = tiny.model("qwen3_moe")
    rule, experts, inter, hidden = _expert_rules(model)
    fused = torch.randn(experts, 2 * inter, hidden)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    saved = hf.revert_weight_conversion([rule], model.config, lambda n: torch.empty(fused.shape, device="meta"),
                                        {name: fused})
    assert len(saved) == 2 * experts
    assert torch.equal(saved["model.layers.0.mlp.experts.5.gate_proj.weight"], fused[5, :inter])
    assert torch.equal(saved["model.layers.0.mlp.experts.5.up_proj.weight"], fused[5, inter:])


@checks("PreTrainedModel._weight_conversions")
def _weight_conversions(tiny):
    """from_pretrained records the rules that matched there, and saving reverses exactly those."""
    from transformers.core_model_loading import revert_weight_conversion

    model = tiny.loaded
    rules = hf.weight_conversions(model)
    assert any(isinstance(r, rule_class("WeightConverter")) and r.was_used() for r in rules), rules
    assert hf.weight_conversions(tiny.model("qwen3_moe")) is None  # built from the config: nothing recorded
    name = "model.layers.0.mlp.experts.down_proj"
    state = {name: model.state_dict()[name]}
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in revert_weight_conversion(model, dict(state))
    try:
        hf.set_weight_conversions(model, [])
        assert list(revert_weight_conversion(model, dict(state))) == [name]  # no rule recorded: saved as it is
    finally:
        hf.set_weight_conversions(model, rules)


@checks("PreTrainedModel._keys_to_ignore_on_load_unexpected")
def _keys_to_ignore(tiny):
    import re

    patterns = hf.keys_to_ignore_on_load_unexpected(tiny.model("deepseek_v3"))
    assert any(re.search(p, "model.layers.61.self_attn.q_a_proj.weight") for p in patterns), patterns  # MTP
    assert isinstance(hf.keys_to_ignore_on_load_unexpected(tiny.model("qwen3_moe")), list)


@checks("FineGrainedFP8HfQuantizer.update_weight_conversions")
def _fp8_scale_renames(tiny):
    def renamed(key, model=None):
        for rule in hf.fp8_scale_renamings(model):
            key, _ = rule.rename_source_key(key)
        return key

    for model in (None, tiny.model("deepseek_v3")):
        assert renamed("layers.0.attn.wq_a.scale", model) == "layers.0.attn.wq_a.weight_scale_inv"  # V4-Flash
        assert renamed("layers.0.attn.wq_a.weight", model) == "layers.0.attn.wq_a.weight"
    if importlib.metadata.version("transformers") >= "5.23":
        assert renamed("layers.0.attention.wq.qscale_weight") == "layers.0.attention.wq.weight_scale_inv"


# ------------------------------------------------------------------ transformers: building a model
@checks("PreTrainedModel._from_config")
def _from_config(tiny):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    config = tiny.model("qwen3_moe").config
    for model_class in (Qwen3MoeForCausalLM, AutoModelForCausalLM):
        with torch.device("meta"):
            model = hf.build_from_config(model_class, config, dtype=torch.bfloat16)
        assert type(model) is Qwen3MoeForCausalLM
        weight = model.model.layers[0].mlp.experts.gate_up_proj
        assert weight.is_meta and weight.dtype == torch.bfloat16


@checks("PreTrainedModel._init_weights")
def _init_weights(tiny):
    """On a model built on meta, the module's _init_weights computes RoPE inv_freq as from_pretrained has it."""
    from transformers import AutoModelForCausalLM

    reference = tiny.model("qwen3_moe")
    with torch.device("meta"):
        model = hf.build_from_config(AutoModelForCausalLM, reference.config, dtype=torch.float32)
    rotary = model.model.rotary_emb
    buffers = th.buffer_slots(rotary)
    for key in th.non_persistent_buffer_names(rotary):
        buffers[key] = torch.full(buffers[key].shape, float("nan"))
    hf.init_weights(model, rotary)
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(rotary.original_inv_freq, reference.model.rotary_emb.original_inv_freq)


@checks("PreTrainedModel._no_split_modules")
def _no_split_modules(tiny):
    from twinkle_strategy.fsdp import find_decoder_layers

    model = tiny.model("qwen3_moe")
    assert "Qwen3MoeDecoderLayer" in hf.no_split_modules(model)
    assert find_decoder_layers(model) == list(model.model.layers)
    assert not hf.no_split_modules(nn.Linear(2, 2))


# ------------------------------------------------------------------ transformers: activation checkpointing
def _train_step(model):
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()


@checks("GradientCheckpointingLayer._gradient_checkpointing_func")
def _checkpointing_function(tiny):
    """The layers transformers checkpoints recompute through the function we put there."""
    model = tiny.fresh("qwen3_moe")
    calls = []

    def wrap(func):
        def counted(*args, **kwargs):
            calls.append(1)
            return func(*args, **kwargs)
        return counted

    for module in model.modules():
        hf.wrap_checkpointing_function(module, wrap)
    assert not calls and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    hf.enable_activation_checkpointing(model, {"use_reentrant": False})
    for module in model.modules():
        hf.wrap_checkpointing_function(module, wrap)
    _train_step(model)
    assert len(calls) == model.config.num_hidden_layers


@checks("PreTrainedModel._activation_checkpointing_enable")
def _checkpointing_enable(tiny):
    """Every way of enabling transformers' checkpointing (the current name and the deprecated one) goes through
    the method we wrap."""
    for enable in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        model = tiny.fresh("qwen3_moe")
        if not hasattr(model, enable):
            continue
        seen = []

        def wrap(method, seen=seen):
            def wrapped(*args, **kwargs):
                seen.append(args[0] if args else kwargs)
                return method(*args, **kwargs)
            return wrapped

        hf.wrap_checkpointing_enable(model, wrap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            getattr(model, enable)({"use_reentrant": False})
        assert seen and seen[0] == {"use_reentrant": False}, (enable, seen)
        assert model.model.layers[0].gradient_checkpointing


@checks("PreTrainedModel.activation_checkpointing_enable")
def _enable_activation_checkpointing(tiny):
    model = tiny.fresh("qwen3_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the current name: no deprecation warning
        hf.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    _train_step(model)


@checks("PreTrainedModel.is_activation_checkpointing")
def _is_activation_checkpointing(tiny):
    model = tiny.fresh("qwen3_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert not hf.is_activation_checkpointing(model)
        hf.enable_activation_checkpointing(model)
        assert hf.is_activation_checkpointing(model)


# ------------------------------------------------------------------ transformers: saving, the HF Trainer
@checks("PreTrainedConfig._attn_implementation")
def _attn_implementation(tiny):
    model = tiny.loaded
    assert hf.attention_implementation(model.config) == "sdpa"
    changed = hf.config_with_attention(model.config, "eager")
    assert hf.attention_implementation(changed) == "eager" and hf.attention_implementation(model.config) == "sdpa"
    # Ulysses relies on transformers building no mask for an attention function outside its mask registry.
    from transformers.masking_utils import create_causal_mask

    from twinkle_strategy.sequence.attention import _MASK_CACHE_ARGUMENT

    custom = hf.config_with_attention(model.config, "not_a_mask_kind")
    embeds = torch.zeros(1, 4, 8)
    positions = torch.tensor([[0, 1, 0, 1]])
    assert create_causal_mask(config=custom, inputs_embeds=embeds, attention_mask=None, position_ids=positions,
                              **{_MASK_CACHE_ARGUMENT: None}) is None


@checks("PreTrainedConfig._experts_implementation", "use_experts_implementation: Experts._apply_gate",
        "use_experts_implementation: Experts._is_expert_parallel")
def _experts_internals(tiny):
    qwen = tiny.model("qwen3_moe")
    experts = qwen.model.layers[0].mlp.experts
    assert hf.experts_implementation(qwen.config) == "grouped_mm"  # transformers' default where torch has it
    assert hf.experts_implementation(experts.config) == "grouped_mm"  # what the experts module dispatches on
    assert hf.experts_implementation(None) is None
    assert hf.under_transformers_expert_parallel(experts) is False
    gate_up = torch.randn(3, experts.gate_up_proj.shape[1])
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(hf.experts_gate(experts)(gate_up), experts.act_fn(gate) * up)
    # gpt-oss: its own gate on the interleaved gate_up (gate at even columns, up at odd ones), clamped.
    oss = tiny.model("gpt_oss").model.layers[0].mlp.experts
    gate_up = torch.randn(3, 8) * 20
    gate, up = gate_up[..., ::2].clamp(max=oss.limit), gate_up[..., 1::2].clamp(-oss.limit, oss.limit)
    assert torch.equal(hf.experts_gate(oss)(gate_up), (up + 1) * (gate * torch.sigmoid(gate * oss.alpha)))
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    assert not hasattr(Llama4TextExperts, "_apply_gate")  # undecorated: lora_experts applies act(gate) * up


@checks("ParamWrapper._did_swap_in_out_features")
def _peft_delta_factors(tiny):
    """PEFT's delta on a fused expert tensor is scaling * lhs @ rhs, in both orientations ([E, out, in]: Qwen3;
    [E, in, out]: gpt-oss), with and without PEFT's own get_delta_factors."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper

    for family in ("qwen3_moe", "gpt_oss"):
        model = get_peft_model(tiny.fresh(family), LoraConfig(
            r=2, lora_alpha=4, init_lora_weights=False, target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
        assert wrappers
        for wrapper in wrappers:
            lhs, rhs, scaling = hf.lora_delta_factors(wrapper, "default")
            delta = scaling * lhs @ rhs
            assert delta.shape == wrapper.get_param().shape
            assert torch.allclose(delta, wrapper.get_delta_weight("default"), atol=1e-6)
            without = types.SimpleNamespace(**{name: getattr(wrapper, name) for name in (
                "lora_A", "lora_B", "num_experts", "_did_swap_in_out_features", "scaling", "get_param")})
            lhs2, rhs2, _ = hf.lora_delta_factors(without, "default")  # as on PEFT 0.20 (no get_delta_factors)
            assert torch.equal(lhs2, lhs) and torch.equal(rhs2, rhs)


@checks("utils.hub.convert_file_size_to_int")
def _file_size(tiny):
    assert hf.file_size_bytes("5GB") == 5 * 10**9
    assert hf.file_size_bytes("500MiB") == 500 * 2**20
    assert hf.file_size_bytes(123) == 123


@checks(*(f"Trainer.{name}" for name in hf.TRAINER_HOOKS))
def _trainer_hooks(tiny):
    """The HF Trainer still has each hook the strategy's trainer mixin (HF, TRL, swift) overrides, with the same
    parameters."""
    from transformers import Trainer

    from twinkle_strategy.integrations.transformers import StrategyTrainerMixin

    hf.check_trainer_overrides(StrategyTrainerMixin)
    for name in hf.TRAINER_HOOKS:
        ours = inspect.signature(vars(StrategyTrainerMixin)[name]).parameters
        theirs = inspect.signature(getattr(Trainer, name)).parameters
        assert list(ours) == list(theirs), (name, list(theirs))
    # A synchronous save goes on to the next class's _save_checkpoint (swift's, then the HF Trainer's).
    calls = []

    class Next(Trainer):
        def __init__(self):  # nothing built: only _save_checkpoint is called
            pass

        def _save_checkpoint(self, model, trial):
            calls.append((model, trial))

    class Mixin:
        pass

    hf.parent_save_checkpoint(type("Trained", (Mixin, Next), {})(), Mixin, "model", None)
    assert calls == [("model", None)]


@checks(*(f"GRPOTrainer.{name}" for name in trl_steps.GRPO_STEPS))
def _grpo_steps(tiny):
    """TRL's GRPOTrainer still has each step the GRPO mixin overrides, taking the parameters the override passes on
    first, and grpo_parent reaches TRL's own."""
    from trl import GRPOTrainer

    from twinkle_strategy.integrations.transformers.grpo import StrategyGRPOTrainerMixin

    trl_steps.check_grpo_overrides(StrategyGRPOTrainerMixin)
    for name in trl_steps.GRPO_STEPS:
        ours = list(inspect.signature(vars(StrategyGRPOTrainerMixin)[name]).parameters)[1:]
        assert ours[:len(trl_steps.GRPO_PARAMETERS[name])] == trl_steps.GRPO_PARAMETERS[name], (name, ours)
    trainer = type("Built", (StrategyGRPOTrainerMixin, GRPOTrainer), {}).__new__(
        type("Built", (StrategyGRPOTrainerMixin, GRPOTrainer), {}))
    step = trl_steps.grpo_parent(trainer, StrategyGRPOTrainerMixin, "_generate_single_turn")
    assert step.__func__ is GRPOTrainer._generate_single_turn


@checks("GRPOTrainer._metrics")
def _grpo_metrics(tiny):
    """GRPOTrainer collects the aux loss it logs in ``_metrics["train"]["aux_loss"]`` (each rank's own term, averaged
    over ranks) and its log line averages each list of ``_metrics`` into the line, then clears them: the value
    replace_logged_metric puts there is the one logged."""
    import collections
    import types

    from trl import GRPOTrainer

    assert 'self._metrics[mode]["aux_loss"].append(' in inspect.getsource(GRPOTrainer._compute_loss)
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    trainer._metrics["train"]["aux_loss"] += [2.354, 2.4]  # TRL's: the ranks' own terms, two micro-batches
    trl_steps.replace_logged_metric(trainer, "aux_loss", 2.289)
    lines = []
    trainer.model = types.SimpleNamespace(training=True)
    trainer.accelerator = types.SimpleNamespace(is_main_process=False)
    trainer.log_completions = False
    with pytest.MonkeyPatch.context() as patch:  # transformers' Trainer.log: what reaches the log history
        from transformers import Trainer

        patch.setattr(Trainer, "log", lambda self, logs, start_time=None: lines.append(dict(logs)))
        trainer.log({"loss": 0.3})
    assert lines == [{"loss": 0.3, "aux_loss": 2.289}], lines
    assert not trainer._metrics["train"]
    trainer._metrics = None
    with pytest.raises(InternalChangedError, match="GRPOTrainer._metrics is no longer a dict"):
        trl_steps.replace_logged_metric(trainer, "aux_loss", 1.0)


@checks("VLLMGeneration.sync_weights", "VLLMGeneration.llm", "VLLMGeneration._llm_weights_sleeping",
        "VLLMGeneration.vllm_client")
def _vllm_generation(tiny):
    """TRL's vLLM backend (read without vLLM: its source) starts its colocated engine as ``llm`` (server mode: its
    client, communicator initialised, as ``vllm_client``), tracks sleeping weights in ``_llm_weights_sleeping``,
    and syncs only through ``sync_weights`` (GRPOTrainer's calls and its own
    wake-up path), so an instance's replacement is what runs; replace_vllm_sync installs it."""
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    assert "self.llm = LLM(" in inspect.getsource(VLLMGeneration._init_vllm)
    assert "self._llm_weights_sleeping = " in inspect.getsource(VLLMGeneration._init_vllm)
    assert "self.vllm_client = VLLMClient(" in inspect.getsource(VLLMGeneration._init_vllm)
    assert "self.vllm_client.init_communicator(" in inspect.getsource(VLLMGeneration._init_vllm)
    assert "self.sync_weights()" in inspect.getsource(VLLMGeneration.generate)
    assert "self.vllm_generation.sync_weights()" in inspect.getsource(GRPOTrainer._generate_single_turn)
    generation, calls = VLLMGeneration.__new__(VLLMGeneration), []
    trl_steps.replace_vllm_sync(generation, lambda: calls.append("ours"))
    generation.sync_weights()
    generation.llm, generation.enable_sleep_mode = "engine", False
    trl_steps.wake_colocated_weights(generation)  # not sleeping: nothing to wake
    assert calls == ["ours"] and trl_steps.colocated_engine(generation) == "engine"
    generation.vllm_client = "client"
    assert trl_steps.server_client(generation) == "client"


@checks("Trainer._save_rng_state")
def _trainer_save_rng_state(tiny):
    """It writes this process's RNG state (rng_state.pth on one process) into a directory it creates, so an
    asynchronous save can take the file at the save step."""
    import tempfile
    import types

    from transformers import Trainer
    from transformers.training_args import ParallelMode

    trainer = Trainer.__new__(Trainer)  # no model, no arguments: only _save_rng_state is called
    trainer.args = types.SimpleNamespace(world_size=1, process_index=0, parallel_mode=ParallelMode.NOT_PARALLEL)
    with tempfile.TemporaryDirectory() as root:
        hf.save_rng_state(trainer, os.path.join(root, "new"))
        assert os.listdir(os.path.join(root, "new")) == ["rng_state.pth"]
        saved = torch.load(os.path.join(root, "new", "rng_state.pth"), weights_only=False)
    assert torch.equal(saved["cpu"], torch.get_rng_state()) and {"python", "numpy"} <= set(saved)


@checks("Trainer._save")
def _trainer_save(tiny):
    from transformers import Trainer

    calls = []

    class Recording(Trainer):
        def __init__(self):  # no model, no arguments: only _save is called
            pass

        def _save(self, output_dir=None, state_dict=None):
            calls.append((output_dir, state_dict))

    hf.trainer_save(Recording(), "out", state_dict={"w": 1})
    assert calls == [("out", {"w": 1})]
    assert list(inspect.signature(Trainer._save).parameters) == ["self", "output_dir", "state_dict"]


@checks("Trainer._prepare_inputs")
def _trainer_prepare_inputs(tiny):
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=tiny.loaded, args=TrainingArguments(output_dir="unused", use_cpu=True, report_to=[]))
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    prepared = hf.trainer_prepare_inputs(trainer, batch)
    assert set(prepared) == set(batch) and prepared["input_ids"].device == trainer.args.device
    assert list(inspect.signature(Trainer._prepare_inputs).parameters) == ["self", "inputs"]


@checks("trainer.SCHEDULER_NAME")
def _scheduler_file(tiny):
    import transformers.trainer

    assert hf.scheduler_file_name() == "scheduler.pt"
    assert "SCHEDULER_NAME" in inspect.getsource(transformers.trainer.Trainer._load_optimizer_and_scheduler)


@checks("model._is_accelerate_prepared")
def _accelerate_prepared(tiny):
    """Accelerator.prepare_model returns a model marked so as it is (no DDP, no move, no second sharding)."""
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator.prepare_model)
    assert 'if getattr(model, "_is_accelerate_prepared", False):' in source
    early = source.split('if getattr(model, "_is_accelerate_prepared", False):', 1)[1].split("\n\n", 1)[0]
    assert "return model" in early, early
    model = nn.Linear(2, 2)
    hf.mark_accelerate_prepared(model)
    assert model._is_accelerate_prepared is True


# ------------------------------------------------------------------ transformers: the MoE load-balancing loss
@checks("modeling_<family>.load_balancing_loss_func")
def _balancing_loss_function(tiny):
    """Each family's forward returns exactly its modeling module's function of its router logits and attention mask
    (in fp32 and bf16), called as (gate_logits, num_experts, top_k, attention_mask); a subclass defined elsewhere
    finds its base class's; a function with other parameters is not taken."""
    import sys

    input_ids = torch.tensor([[3, 5, 7, 9, 11, 13], [2, 4, 6, 8, 0, 0]])
    attention_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny.fresh(family).to(dtype)
            function = hf.balancing_loss_function(model)
            assert function is sys.modules[type(model).__module__].load_balancing_loss_func, family
            with torch.no_grad():
                out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
                again = function(out.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
            assert torch.equal(out.aux_loss, again), (family, dtype, out.aux_loss, again)
    subclass = type("Elsewhere", (type(tiny.model("qwen3_moe")),), {"__module__": __name__})
    assert hf.balancing_loss_function(subclass.__new__(subclass)) is \
        sys.modules[type(tiny.model("qwen3_moe")).__module__].load_balancing_loss_func
    assert hf.balancing_loss_function(nn.Linear(2, 2)) is None
    from transformers.models.doge import modeling_doge  # (gate_logits, num_experts, num_keys, top_k, ...)

    doge = type("Doge", (nn.Module,), {"__module__": modeling_doge.__name__})
    assert callable(modeling_doge.load_balancing_loss_func) and hf.balancing_loss_function(doge()) is None


# ------------------------------------------------------------------ torch
@checks("nn.Module._parameters")
def _parameter_slots(tiny):
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    second.weight = first.weight  # tied
    replacement = nn.Parameter(torch.empty(2, 3, dtype=torch.bfloat16, device="meta"))
    for module in (first, second):
        slots = th.parameter_slots(module)
        assert list(slots) == ["weight", "bias"]
        slots["weight"] = replacement
    assert first.weight is replacement and second.weight is replacement
    assert [n for n, _ in first.named_parameters()] == ["weight", "bias"]


@checks("nn.Module._buffers")
def _buffer_slots(tiny):
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(2))
    module.register_buffer("computed", torch.zeros(2), persistent=False)
    slots = th.buffer_slots(module)
    assert list(slots) == ["kept", "computed"]
    slots["computed"] = torch.ones(3)
    assert torch.equal(module.computed, torch.ones(3)) and list(module.state_dict()) == ["kept"]


@checks("nn.Module._non_persistent_buffers_set")
def _non_persistent(tiny):
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(2))
    module.register_buffer("computed", torch.zeros(2), persistent=False)
    assert th.non_persistent_buffer_names(module) == {"computed"}
    rotary = tiny.model("qwen3_moe").model.rotary_emb
    assert th.non_persistent_buffer_names(rotary) >= {"inv_freq"}


@checks("Tensor._make_wrapper_subclass")
def _wrapper_subclass(tiny):
    """A placeholder has any shape, dtype and device and holds no storage (4 TiB here, made at once)."""
    from twinkle_strategy.init.skeleton import CheckpointTensor

    for device in ("cpu", "meta"):
        placeholder = CheckpointTensor("w", None, (2**20, 2**21), torch.bfloat16, device)
        assert type(placeholder) is CheckpointTensor and placeholder.shape == (2**20, 2**21)
        assert placeholder.dtype == torch.bfloat16 and placeholder.device.type == device
        assert not placeholder.requires_grad


@checks("torch._subclasses.fake_tensor.FakeTensorMode")
def _fake_tensor_mode(tiny):
    """Tensors made in the mode have a device, shape and dtype and no storage; a model computes on them (a
    64 GiB weight here), including autograd."""
    mode = th.fake_tensor_mode()
    with mode:
        weight = torch.nn.Parameter(torch.empty(2**17, 2**17, dtype=torch.float32, device="cpu"))
        x = torch.randn(3, 2**17, requires_grad=True)
        y = torch.nn.functional.linear(x, weight)
        y.sum().backward()
    assert type(weight).__name__ == "FakeTensor" or type(weight.data).__name__ == "FakeTensor"
    assert y.shape == (3, 2**17) and weight.grad.shape == weight.shape and weight.device.type == "cpu"


@checks("torch.utils._python_dispatch.TorchDispatchMode")
def _dispatch_mode(tiny):
    """The counter sees fake tensors made inside ``run`` and the moment they are freed: a linear layer's
    forward and backward on fake tensors peaks at its known bytes, with the inputs (made before) left out."""
    mode = th.fake_tensor_mode()
    with mode:
        layer = torch.nn.Linear(256, 1024)
        x = torch.randn(64, 256, requires_grad=True)

        def run():
            torch.nn.functional.gelu(layer(x)).sum().backward()

        peak = th.peak_tracked_bytes(run)

        def transient():
            for _ in range(3):
                torch.empty(2**20, dtype=torch.uint8)  # freed at once: never two alive

        held = th.peak_tracked_bytes(transient)
    # The linear's output (64 x 1024 fp32, kept for GELU's backward), then gradients of weight, bias and x.
    weights = (1024 * 256 + 1024) * 4
    assert held == 2**20
    assert 64 * 1024 * 4 + weights <= peak <= 4 * 64 * 1024 * 4 + weights + 64 * 256 * 4, peak


@checks("torch._C._disabled_torch_function_impl")
def _disabled_torch_function(tiny):
    """Operations on a placeholder reach its __torch_dispatch__ directly; results are not re-wrapped."""
    from twinkle_strategy.errors import WeightsNotLoadedError
    from twinkle_strategy.init.skeleton import CheckpointTensor

    class Plain(torch.Tensor):
        __torch_function__ = th.disabled_torch_function()

    assert type(torch.Tensor._make_subclass(Plain, torch.ones(2)) + 1) is torch.Tensor
    placeholder = CheckpointTensor("w", None, (2, 3), torch.float32, "cpu")
    with pytest.raises(WeightsNotLoadedError, match="'w' has no values yet"):
        torch.add(placeholder, 1)
    parameter = nn.Parameter(placeholder, requires_grad=False)  # through detach, in __torch_dispatch__
    assert isinstance(parameter, CheckpointTensor) and parameter.key == "w"


@checks("distributed_c10d._get_default_store")
def _default_store(tiny):
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = th.default_store()
        store.set("twinkle/internals", "ok")
        assert store.get("twinkle/internals") == b"ok"
    finally:
        if started:
            dist.destroy_process_group()


@checks("ProcessGroupGloo.runLoop")
def _gloo_worker_threads(tiny):
    """A gloo group's workers are found by their name, and are seen waiting once its collective is done."""
    import torch.distributed as dist

    from twinkle_strategy.distributed.runtime import settle_gloo_workers

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1))
        states = th.gloo_worker_states()
        assert states, f"no thread named {th.GLOO_WORKER_THREAD_NAME}: {states}"
        assert settle_gloo_workers(timeout_s=5.0), th.gloo_worker_states()
    finally:
        if started:
            dist.destroy_process_group()


@checks("DTensor._local_tensor")
def _dtensor_local_tensor(tiny):
    """A swapped local tensor is what to_local gives and what FSDP2 gathers after its lazy init (which re-reads
    each parameter's local tensor: quantized_base=keep swaps in a kept weight there)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = torch.nn.Linear(4, 3, bias=False).requires_grad_(False)
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        swapped = torch.full((3, 4), 2.0)
        old = th.replace_local_tensor(layer.weight, swapped)
        assert old.shape == (3, 4) and torch.equal(layer.weight.to_local(), swapped)
        assert torch.equal(layer(torch.ones(1, 4)), torch.full((1, 3), 8.0))
    finally:
        if started:
            dist.destroy_process_group()


@checks("torch._foreach_norm")
def _foreach_norm(tiny):
    """One call gives each tensor's norm in fp32 (a bf16 tensor's too), the same as linalg.vector_norm's."""
    tensors = [torch.randn(5, 3), torch.randn(7).to(torch.bfloat16), torch.randn(1)]
    for norm_type in (2.0, 1.0, float("inf")):
        for group in (tensors[::2], tensors[1:2]):
            norms = th.foreach_norm(group, norm_type)
            assert [n.dtype for n in norms] == [torch.float32] * len(group) and all(n.shape == () for n in norms)
            want = [torch.linalg.vector_norm(t.float(), norm_type) for t in group]
            torch.testing.assert_close(list(norms), want, rtol=1e-6, atol=0)


@checks("torch._foreach_mul_")
def _foreach_mul(tiny):
    """Each tensor is multiplied in place by a 0-dim tensor factor, as Tensor.mul_ would (bf16 included)."""
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(4, 3, dtype=dtype), torch.randn(2, dtype=dtype)]
        want = [t * torch.tensor(0.37, dtype=dtype) for t in tensors]
        storages = [t.data_ptr() for t in tensors]
        th.foreach_mul_(tensors, torch.tensor(0.37, dtype=dtype))
        assert [t.data_ptr() for t in tensors] == storages  # in place
        assert all(torch.equal(got, w) for got, w in zip(tensors, want, strict=True))


# ------------------------------------------------------------------ a missing internal is named
def test_a_missing_internal_is_named_with_the_installed_version(monkeypatch, tiny):
    import re

    import torch.distributed as dist
    from transformers import PreTrainedModel, core_model_loading

    from twinkle_strategy.distributed.liveness import _store

    model = tiny.model("deepseek_v3")
    version = re.escape(importlib.metadata.version("transformers"))
    monkeypatch.delattr(PreTrainedModel, "_get_dtype_plan")
    with pytest.raises(InternalChangedError, match=rf"^transformers {version}: PreTrainedModel._get_dtype_plan is "
                                                   r"gone; twinkle_strategy uses it to ask which tensors"):
        hf.dtype_plan(model, torch.bfloat16)
    monkeypatch.delattr(core_model_loading, "MergeModulelist")
    with pytest.raises(InternalChangedError, match=rf"transformers {version}: core_model_loading.MergeModulelist "
                                                   r"is gone.*checked on transformers 5.19, 5.23, 5.24"):
        rule_class("MergeModulelist")
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(InternalChangedError, match=rf"torch {re.escape(importlib.metadata.version('torch'))}: "
                                                   r"distributed_c10d._get_default_store is gone"):
        _store()  # liveness lets this one through (other failures to reach the store just mean "no store")


def test_the_strategy_trainers_override_only_registered_hooks():
    """Each private method the strategy's trainer mixin (and swift's on top of it) defines is ours, swift's, or a
    registered HF Trainer hook (checked when the trainer class is built: an override of a renamed hook would
    silently never run)."""
    from twinkle_strategy.integrations.swift.plugin import TwinkleTrainerMixin
    from twinkle_strategy.integrations.transformers import StrategyTrainerMixin

    ours = {"_wrap_with_strategy"}
    private = {n for n in vars(StrategyTrainerMixin) if n.startswith("_") and not n.startswith("__")}
    assert private - ours == set(hf.TRAINER_HOOKS)
    from twinkle_strategy.integrations.transformers.grpo import StrategyGRPOTrainerMixin

    grpo_own = {"_trl", "_padded_record", "_scores_the_reference", "_replayed_logps"}
    private = {n for n in vars(StrategyGRPOTrainerMixin) if n.startswith("_") and not n.startswith("__")}
    assert private - grpo_own == set(trl_steps.GRPO_STEPS)
    swift_own = {"_save_model", "_compute_acc"}  # swift's trainer mixin, not transformers'
    private = {n for n in vars(TwinkleTrainerMixin) if n.startswith("_") and not n.startswith("__")}
    assert private - swift_own <= set(hf.TRAINER_HOOKS)
    renamed = type("Renamed", (), {"_load_optimizer_and_scheduler_v2": None})
    hf.check_trainer_overrides(renamed)  # not one of ours: nothing to check
    hooks = dict(vars(TwinkleTrainerMixin))
    with pytest.MonkeyPatch.context() as patch:
        from transformers import Trainer

        patch.delattr(Trainer, "_load_optimizer_and_scheduler")
        with pytest.raises(InternalChangedError, match="Trainer._load_optimizer_and_scheduler is gone, so its "
                                                       "override would never run"):
            hf.check_trainer_overrides(TwinkleTrainerMixin)
    assert dict(vars(TwinkleTrainerMixin)) == hooks


# ------------------------------------------------------------------ the one home
PRIVATE_MODULES = ("transformers.core_model_loading", "transformers.conversion_mapping", "transformers.utils.hub",
                   "transformers.quantizers", "transformers.modeling_utils", "transformers.trainer")
OTHER_LIBRARIES = ("transformers", "torch", "accelerate", "peft")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(trees) -> set[str]:
    """The private names twinkle_strategy defines itself: methods and class attributes of its classes, attributes
    it assigns on ``self``/``cls``; minus the names of registered internals (an override of the HF Trainer's
    ``_save`` is not ours)."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = [item] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                        getattr(item, "targets", None) or [getattr(item, "target", None)]
                    own.update(getattr(t, "name", None) or getattr(t, "id", "") for t in targets if t is not None)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    internal_names = {internal.name.rsplit(".", 1)[1] for internal in INTERNALS}
    return {n for n in own if _is_private(n)} - internal_names


def private_uses(tree, own: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` touches a private name of another library. The rule, kept simple:

    * ``x._name`` (any object, ``self`` included; not dunders) unless ``_name`` is one of ``own`` (defined by
      twinkle_strategy) or a ``_twinkle...`` marker it sets on other objects;
    * ``getattr``/``hasattr``/``setattr``/``delattr`` with such a name as a string;
    * an import of a module with a private component (``torch._C``, ``torch.utils._pytree``) or of a private
      name, from transformers, torch, accelerate or peft; and any import from the modules of transformers
      whose contents are internals (``PRIVATE_MODULES``: ``core_model_loading``, ``conversion_mapping``, ...).
    """
    def foreign(name: str) -> bool:
        return _is_private(name) and name not in own and not name.startswith("_twinkle")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and foreign(node.attr):
            found.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                foreign(node.args[1].value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                if module.split(".")[0] not in OTHER_LIBRARIES or getattr(node, "level", 0):
                    continue
                if any(_is_private(part) for part in module.split(".")) or any(_is_private(n) for n in names) or \
                        any(module == m or module.startswith(m + ".") for m in PRIVATE_MODULES):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_outside_compat_touches_a_private_name_of_another_library():
    files = [p for p in PACKAGE.rglob("*.py")]
    trees = {p: ast.parse(p.read_text()) for p in files}
    own = own_private_names(trees.values())
    offenders = {str(p.relative_to(PACKAGE.parent)): uses for p, tree in trees.items()
                 if "compat" not in p.relative_to(PACKAGE).parts and (uses := private_uses(tree, own))}
    assert not offenders, f"use twinkle_strategy.compat's wrappers (or add one there): {offenders}"
    assert len(files) > 40  # the walk saw the package


def test_the_scan_finds_each_kind_of_private_use():
    own = own_private_names([ast.parse("class Ours:\n    def _plan(self):\n        self._rows = 1\n")])
    assert own == {"_plan", "_rows"}
    source = "\n".join([
        "model._weight_conversions = rules",  # 1
        "x = getattr(module, '_no_split_modules', None)",  # 2
        "from transformers.core_model_loading import WeightRenaming",  # 3
        "f = torch._C._disabled_torch_function_impl",  # 4
        "from torch.utils._pytree import tree_flatten",  # 5
        "self._save(output_dir)",  # 6: the HF Trainer's, not ours
        "layout._plan(recipe)",  # ours
        "self._rows += 1",  # ours
        "hook._twinkle_hook = True",  # our marker
        "from transformers import PreTrainedModel",  # public
        "import torch.distributed as dist",  # public
    ])
    assert sorted(line for line, _ in private_uses(ast.parse(source), own)) == [1, 2, 3, 4, 4, 5, 6]
