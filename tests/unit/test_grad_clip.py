"""Gradient clipping (``twinkle_strategy.distributed.grad_clip``): the numbers of the per-parameter loop it
replaced, at the cost of torch's own clipping.

* Numbers: a real tiny MoE's gradients, plain and as FSDP2 DTensors (a real gloo world of one), clipped in
  fp32 and bf16 for the 1-, 2-, 3- and inf-norms: the norm and the scaled gradients equal the per-parameter loop's
  (the function as it was, below) within 1e-6 relative, and torch.nn.utils.clip_grad_norm_'s on plain tensors.
* Cost: the ATen ops clipping runs, seen through a TorchDispatchMode: the norm and scaling kernels do not grow with
  the number of parameters (one per device and dtype), and nothing syncs with the host
  (``aten._local_scalar_dense``, what ``.item()`` and a tensor's ``bool()`` run).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle_strategy.distributed.dtensor import local_tensor
from twinkle_strategy.distributed.grad_clip import clip_grad_norm_
from twinkle_strategy.testing.tiny_models import build_tiny_model

NORM_TYPES = (2.0, 1.0, 3.0, math.inf)
RELATIVE = 1e-6


@torch.no_grad()
def per_parameter_clip(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """The clipping as it was before the foreach kernels (one norm and one multiply per parameter), world of one."""
    total = torch.zeros((), dtype=torch.float32)
    if math.isinf(norm_type):
        for g in grads:
            local = local_tensor(g)
            if local.numel():
                total = torch.maximum(total, local.detach().abs().max().float())
    else:
        for g in grads:
            total += torch.linalg.vector_norm(local_tensor(g).detach().float(), norm_type) ** norm_type
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef.to(local_tensor(g).dtype))
    return total


@pytest.fixture(scope="module")
def world_of_one():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _model_with_grads(*, sharded: bool, dtype: torch.dtype, mesh=None) -> nn.Module:
    model = build_tiny_model("qwen3_moe", seed=0).to(dtype)
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    batch = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    model(input_ids=batch, labels=batch).loss.backward()
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [local_tensor(p.grad).clone() for p in model.parameters() if p.grad is not None]


def _put_grads(model: nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip([p for p in model.parameters() if p.grad is not None], grads, strict=True):
        local_tensor(p.grad).copy_(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dtensor"])
def test_clipping_gives_the_per_parameter_loops_numbers(sharded, dtype, world_of_one):
    model = _model_with_grads(sharded=sharded, dtype=dtype, mesh=world_of_one)
    assert sharded == isinstance(next(model.parameters()).grad, DTensor)
    before = _grads(model)
    for norm_type in NORM_TYPES:
        expected_grads = [g.clone() for g in before]
        expected = per_parameter_clip(expected_grads, 0.05, norm_type)
        _put_grads(model, before)
        total = clip_grad_norm_(model, 0.05, norm_type)
        assert total.dtype == torch.float32 and total.shape == ()
        assert float(expected) > 0.05, "max_norm must clip for the test to compare scaled gradients"
        torch.testing.assert_close(total, expected, rtol=RELATIVE, atol=0, msg=f"{norm_type}-norm")
        for got, want in zip(_grads(model), expected_grads, strict=True):
            # fp32: within 1e-6; bf16: the coefficient rounds to bf16 first, the same rounding in both.
            torch.testing.assert_close(got.float(), want.float(), rtol=RELATIVE, atol=0, msg=f"{norm_type}-norm")
        if not sharded and dtype == torch.float32:
            # torch's own clipping, where it can run (one device, no DTensors of several meshes; it takes a bf16
            # gradient's norm in bf16, twinkle and the loop in fp32)
            plain = [g.clone() for g in before]
            for p, g in zip([p for p in model.parameters() if p.grad is not None], plain, strict=True):
                p.grad = g
            reference = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
            torch.testing.assert_close(total, reference.float(), rtol=RELATIVE, atol=0)


class _CountOps(TorchDispatchMode):
    """Counts every ATen op run inside it, by name (``aten.linalg_vector_norm``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_of_clipping(layers: int, *, sharded: bool, mesh) -> collections.Counter:
    """The ops of clipping a stack of ``layers`` linear layers (two parameters each) and fp32 + bf16 norms."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)], nn.LayerNorm(8).to(torch.bfloat16))
    model[-1].weight.grad = torch.ones(8, dtype=torch.bfloat16)
    if sharded:
        for layer in model[:-1]:
            fully_shard(layer, mesh=mesh)
    model[:-1](torch.randn(2, 8)).sum().backward()
    with _CountOps() as counter:
        clip_grad_norm_(model, 0.01)
    return counter.counts


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dtensor"])
def test_clipping_runs_one_norm_and_one_scaling_per_device_and_dtype_and_no_host_sync(sharded, world_of_one):
    few, many = (_ops_of_clipping(n, sharded=sharded, mesh=world_of_one) for n in (2, 40))
    norms = ("aten.linalg_vector_norm", "aten._foreach_norm", "aten.norm")
    scalings = ("aten.mul_", "aten._foreach_mul_", "aten.mul")
    for kind in (*norms, *scalings):
        assert few[kind] == many[kind], f"{kind}: {few[kind]} calls for 5 parameters, {many[kind]} for 81"
    # Two groups (fp32 and bf16 gradients): a norm kernel and a scaling kernel each.
    assert sum(many[k] for k in norms) <= 2 and many["aten._foreach_mul_"] == 2, many
    assert many["aten._local_scalar_dense"] == 0, "clipping synchronizes with the host"
    assert sum(many.values()) == sum(few.values()), (few, many)
