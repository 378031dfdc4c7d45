"""bf16's kept dtypes and FSDP2's units, on meta skeletons in one process: a parameter transformers keeps in fp32
gets a unit of its own, and a module holding both dtypes itself is refused by name. (The bf16 runs against one
process: tests/multiproc/test_bf16.py.)"""

import pytest
import torch


def fsdp_groups(model, units, experts=()) -> list[set]:
    """The dtypes of the parameters each fully_shard unit would manage: units bottom-up, then the decoder layers,
    then the root, each taking what no earlier unit took (what fully_shard does)."""
    from twinkle_strategy.fsdp import find_decoder_layers

    claimed, groups = set(), []
    for module in [*experts, *[m for m, _ in units], *find_decoder_layers(model), model]:
        params = [p for p in module.parameters() if id(p) not in claimed]
        claimed |= {id(p) for p in params}
        groups.append({p.dtype for p in params})
    return groups


@pytest.mark.parametrize("family", ["deepseek_v4", "ernie4_5_moe", "hunyuan_v1_moe", "flint"])
def test_fsdp_units_never_mix_dtypes(family):
    """FSDP2 needs one dtype per unit: fp32-kept parameters (Ernie's router, V4's norms and the attention sinks
    beside bf16 projections, HunYuan's router built in fp32) get units of their own, kept in fp32."""
    from twinkle_strategy.dtypes import kept_parameters
    from twinkle_strategy.fsdp import kept_dtype_units
    from twinkle_strategy.loading import meta_skeleton
    from twinkle_strategy.testing.tiny_models import tiny_config

    model = meta_skeleton(tiny_config(family), torch.bfloat16)
    kept = kept_parameters(model, torch.bfloat16)
    assert kept and {p.dtype for p in model.parameters() if id(p) in kept} == {torch.float32}
    units = kept_dtype_units(model, kept)
    groups = fsdp_groups(model, units)
    assert all(len(group) <= 1 for group in groups), family
    assert [group for group, (_, keeps) in zip(groups, units, strict=False) if keeps] == [{torch.float32}] * sum(
        keeps for _, keeps in units), family


def test_a_module_holding_both_dtypes_itself_is_refused_naming_it():
    """Inkling's router holds its bf16 weight and an fp32-kept global_scale itself: no FSDP2 unit can keep them
    apart, so wrapping says so, naming the module, instead of FSDP2's assertion at the first forward."""
    from twinkle_strategy.dtypes import kept_parameters
    from twinkle_strategy.errors import ModelStructureError
    from twinkle_strategy.fsdp import kept_dtype_units
    from twinkle_strategy.loading import meta_skeleton
    from twinkle_strategy.testing.tiny_models import tiny_config

    model = meta_skeleton(tiny_config("inkling_text"), torch.bfloat16)
    with pytest.raises(ModelStructureError, match=r"module 'model\.layers\.0\.mlp\.gate' \(\w+\) holds parameters "
                                                  r"transformers keeps in their own dtype \(\['global_scale'\]\)"):
        kept_dtype_units(model, kept_parameters(model, torch.bfloat16))
