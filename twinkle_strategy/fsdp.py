"""FSDP2 wrapping: experts on the ep_fsdp mesh, everything else on the flat fsdp mesh."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from twinkle_strategy.compat.transformers_internals import no_split_modules
from twinkle_strategy.config import MixedPrecision
from twinkle_strategy.dtypes import FLOAT_DTYPES, kept_parameters, loaded_dtype
from twinkle_strategy.errors import CallOrderError, ModelStructureError, StrategyConfigError
from twinkle_strategy.parallel import Meshes

_NO_MIXED_PRECISION = {None, MixedPrecision.NO, "fp32", "float32"}


def mixed_precision_policy(mixed_precision: MixedPrecision | str | None, *,
                           reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """Compute in ``mixed_precision`` (bf16/fp16) and reduce gradients in ``reduce_dtype`` (a float dtype name).

    'no'/'fp32' computes in the parameters' own dtypes and, with the default float32, reduces each gradient in its
    parameter's dtype (an fp32 model in fp32, as always); another ``reduce_dtype`` casts the gradients to it for
    the reduce. :func:`apply_fsdp` gives a mesh of one rank :func:`reducing_nothing` of it instead: a world of one
    gets the same gradients whatever ``reduce_dtype`` says.
    """
    if reduce_dtype not in FLOAT_DTYPES:
        raise StrategyConfigError(
            "reduce_dtype", f"reduce_dtype={reduce_dtype!r} is not supported; use 'float32', 'bfloat16' or 'float16'"
        )
    reduce = FLOAT_DTYPES[reduce_dtype]
    if mixed_precision in _NO_MIXED_PRECISION:
        return MixedPrecisionPolicy() if reduce == torch.float32 else MixedPrecisionPolicy(reduce_dtype=reduce)
    if mixed_precision not in FLOAT_DTYPES:
        raise StrategyConfigError(
            "mixed_precision", f"mixed_precision={mixed_precision!r} is not supported; use 'bf16', 'fp16' or 'no'"
        )
    return MixedPrecisionPolicy(param_dtype=FLOAT_DTYPES[mixed_precision], reduce_dtype=reduce)


def reducing_nothing(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """``policy`` for a mesh of one rank: its gradients are reduced in the compute dtype, not cast to
    ``reduce_dtype`` first. The numbers are the same (a reduction over one rank adds nothing and the result is cast
    to the parameter's dtype either way); the cast (FSDP2's copy-in, a pass over every gradient) is not paid."""
    return dataclasses.replace(policy, reduce_dtype=policy.param_dtype)


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found through transformers' ``_no_split_modules``."""
    class_names: set[str] = set()
    for module in model.modules():
        class_names.update(no_split_modules(module))
    layers = [m for m in model.modules() if type(m).__name__ in class_names]
    if layers:
        return layers
    # Fallback for models without the attribute: children of any ModuleList named "layers".
    return [layer for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)
            for layer in m]


def apply_fsdp(
    model: nn.Module,
    meshes: Meshes,
    experts_modules: list[nn.Module],
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` bottom-up: experts, modules kept in their own dtype, then each decoder layer, then the root.

    Expert gradients need no special divide factor here: the token dispatch
    already scales them so that FSDP's default mean over ``ep_fsdp`` gives the
    world mean (see :func:`twinkle_strategy.moe.dispatch.dispatch`).
    """
    def shard(module, mesh, policy):
        policy = policy if mesh.size() > 1 else reducing_nothing(policy)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)

    loaded = loaded_dtype(model)
    if mp_policy.param_dtype is not None and mp_policy.param_dtype == loaded:
        # A model loaded in the compute dtype gets its inputs in it already, except those it keeps in fp32 on
        # purpose (Ernie-4.5's rotary cos/sin): casting them would compute otherwise than one process does.
        mp_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for experts in experts_modules:
        shard(experts, meshes.ep_fsdp_mesh, mp_policy)
    kept = kept_parameters(model, mp_policy.param_dtype or loaded)
    kept_units = []
    for module, keeps_dtype in kept_dtype_units(model, kept, experts_modules=experts_modules):
        if keeps_dtype:
            # param_dtype=None: computed (and reduced) in the dtype transformers gave them, whatever the policy.
            fully_shard(module, mesh=meshes.fsdp, mp_policy=KEEP_DTYPE_POLICY, reshard_after_forward=False)
            kept_units.append(module)
        else:
            shard(module, meshes.fsdp, mp_policy)
    for layer in find_decoder_layers(model):
        if not isinstance(layer, FSDPModule):  # (a layer that itself holds kept parameters is a unit already)
            shard(layer, meshes.fsdp, mp_policy)
    shard(model, meshes.fsdp, mp_policy)
    if kept_units:
        unshard_while_computing(model, kept_units)
    return model


def unshard_while_computing(model: nn.Module, units: list[nn.Module]) -> None:
    """Gather ``units`` when ``model``'s forward starts and keep them gathered until backward is done.

    FSDP2 gathers a unit when its module's forward runs, but models also use such small modules'
    parameters without calling them (Bailing's attention hands ``conv1d.weight`` to a kernel). So these
    units (``reshard_after_forward=False``) are gathered up front; FSDP's end-of-backward callback then
    reduces their gradients and reshards them, whether or not their module ran. A forward without
    gradients reshards them at its end, so between steps every parameter is a shard again.
    """
    def gather(module, args):
        for unit in units:
            unit.unshard()

    def reshard_without_backward(module, args, output):
        if not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()

    model.register_forward_pre_hook(gather)
    model.register_forward_hook(reshard_without_backward)


# Leaves each parameter in its own dtype, for compute and for the gradient reduction.
KEEP_DTYPE_POLICY = MixedPrecisionPolicy()


class _Params(enum.Enum):
    """The two kinds of parameters that may not share a unit."""

    KEPT = "kept"  # kept in their own dtype (fp32-kept modules)
    OTHER = "other"


def kept_dtype_units(model: nn.Module, kept: set[int], *,
                     experts_modules: list[nn.Module] = ()) -> list[tuple[nn.Module, bool]]:
    """The extra ``fully_shard`` units that keep ``kept`` parameters apart from the others, bottom-up.

    FSDP2 needs one original dtype per unit, and a bf16 policy would cast a unit's fp32 router
    to bf16 (which changes routing). So each module holding kept parameters only becomes a unit
    of its own (True: leave its dtype); where a module holds kept parameters itself and others in
    children (DeepSeek-V4's attention ``sinks`` beside its projections), those children become
    units under the model's policy first (False), so that the module's unit holds only kept ones.
    """
    units: list[tuple[nn.Module, bool]] = []
    opaque = {id(m) for m in experts_modules}  # units of their own already

    def visit(module: nn.Module, name: str) -> set[_Params]:
        """The kinds of parameters under ``module`` that no unit below it holds yet."""
        own = {_Params.KEPT if id(p) in kept else _Params.OTHER for p in module.parameters(recurse=False)}
        below = {child: visit(child, f"{name}.{key}".lstrip(".")) for key, child in module.named_children()}
        kinds = own.union(*below.values())
        if len(kinds) > 1 and (id(module) in opaque or len(own) > 1):
            raise ModelStructureError(_mixed_message(name, module, kept))
        if id(module) in opaque or len(kinds) < 2:
            return set() if id(module) in opaque else kinds
        units.extend(_units_beside(own, below))
        if own == {_Params.KEPT}:
            units.append((module, True))
            return set()
        return {_Params.OTHER}

    if kept:
        visit(model, "")
    return units


def _units_beside(own: set[_Params], children: dict[nn.Module, set[_Params]]) -> list[tuple[nn.Module, bool]]:
    """Of a module whose parameters mix both kinds: the children that must be units of their own."""
    if own == {_Params.KEPT}:  # the module will be a kept unit: every child holding others must be a unit first
        return [(child, False) for child, left in children.items() if left == {_Params.OTHER}]
    return [(child, True) for child, left in children.items() if left == {_Params.KEPT}]


def _mixed_message(name: str, module: nn.Module, kept: set[int]) -> str:
    dtypes = {key: p.dtype for key, p in module.named_parameters() if p is not None}
    kept_names = [key for key, p in module.named_parameters() if id(p) in kept]
    return (f"module '{name}' ({type(module).__name__}) holds parameters transformers keeps in their own dtype "
            f"({kept_names}) beside others ({dtypes}) in one module, and FSDP2 shards a module's parameters as one "
            "unit with one dtype. Load the model with dtype=torch.float32 and mixed_precision='no', or keep "
            "this module out of training")


def rebind_optimizer(optimizer, names_by_param: dict[int, str], model: nn.Module):
    """Point ``optimizer`` at ``model``'s sharded parameters (``names_by_param``: id of each parameter it was built
    with -> its name): its class, hyper-parameters and groups stay as the user built them."""
    if len(optimizer.state) > 0:
        raise CallOrderError(
            "wrap_model got an optimizer that has already stepped; its state belongs to the unsharded "
            "parameters. Create the optimizer before training, or load its state after wrap_model"
        )
    params_by_name = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params_by_name[names_by_param[id(p)]] for p in group["params"]]
    return optimizer
