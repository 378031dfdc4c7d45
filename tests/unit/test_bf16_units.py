"""bf16's kept dtypes and FSDP2's units, on meta skeletons in one process: a parameter transformers keeps in fp32
gets a unit of its own, and a module holding both dtypes itself is refused by name. (The bf16 runs against one
process: tests/multiproc/test_bf16.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


class _ReduceInputs(TorchDispatchMode):
    """The dtypes of FSDP2's reduce-scatter inputs: its copy-in (``fsdp::chunk_cat``, into a buffer of the reduce
    dtype) casts the gradients there."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.fsdp.chunk_cat:
            self.dtypes.add(kwargs["out"].dtype if "out" in kwargs else args[3].dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_a_world_of_one_gets_the_same_gradients_whatever_the_reduce_dtype(mixed_precision):
    """reduce_dtype changes how the ranks' gradients are summed; a world of one (a real gloo group) sums nothing:
    its gradients are bit for bit those of the default fp32 reduce, and FSDP2 reduces them in the compute dtype
    there (no cast of every gradient to reduce_dtype for a reduction that adds nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from twinkle_strategy.distributed.dtensor import local_tensor
    from twinkle_strategy.fsdp import apply_fsdp, mixed_precision_policy
    from twinkle_strategy.parallel import Meshes
    from twinkle_strategy.testing.tiny_models import build_tiny_model

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads, reduced_in = {}, {}
        for reduce_dtype in ("float32", "bfloat16"):
            policy = mixed_precision_policy(mixed_precision, reduce_dtype=reduce_dtype)
            assert policy.reduce_dtype == {"float32": None if mixed_precision == "no" else torch.float32,
                                           "bfloat16": torch.bfloat16}[reduce_dtype]
            model = build_tiny_model("qwen3_moe", seed=0)  # fp32: a bf16 reduce would round its gradients
            apply_fsdp(model, Meshes(fsdp=init_device_mesh("cpu", (1,)), expert=None), [], policy)
            batch = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
            loss = model(input_ids=batch, labels=batch).loss
            with _ReduceInputs() as inputs:
                loss.backward()
            grads[reduce_dtype] = [local_tensor(p.grad).clone() for p in model.parameters()]
            reduced_in[reduce_dtype] = inputs.dtypes
        assert all(g.dtype == torch.float32 for g in grads["bfloat16"])
        assert all(torch.equal(a, b) for a, b in zip(grads["float32"], grads["bfloat16"], strict=True))
        compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
        assert reduced_in == {"float32": {compute}, "bfloat16": {compute}}, reduced_in
    finally:
        if started:
            dist.destroy_process_group()
