"""The optimizer step and gradient clipping: AdamW foreach against fused, and clipping one kernel per parameter
(the loop twinkle_strategy had) against one per device and dtype (``clip_grad_norm_`` now), on CPU or a GPU.

    python benchmarks/optimizer_bench.py                  # CPU, fp32 and bf16 (the reported run, ~1 min)
    python benchmarks/optimizer_bench.py --device cuda --small 1000 --big-rows 8192   # a GPU
    python benchmarks/optimizer_bench.py --quick          # smoke run

One process. The parameters are what a transformer has: many small tensors (norms, biases, routers: ``--small``
of ``--small-size`` elements) and a few big ones (``--big`` matrices of ``--big-rows`` x ``--big-cols``), with
random gradients. Each round times every method once (``--steps`` steps each, after a warm-up), rounds
interleaved so that the machine's load falls on all of them; reported: the median step time over ``--repeat``
rounds and the ratio to the first method of its group.

  adamw foreach          torch.optim.AdamW(foreach=True): what twinkle-sft's ``optim: adamw_torch`` runs
  adamw fused            torch.optim.AdamW(fused=True): twinkle-sft's default (``adamw_torch_fused``)
  clip per parameter     the loop twinkle_strategy's clip_grad_norm_ had: one norm and one multiply per gradient
  clip foreach           twinkle_strategy's clip_grad_norm_: one norm and one multiply per device and dtype
  torch clip_grad_norm_  torch.nn.utils.clip_grad_norm_ (foreach), for reference (plain tensors only)

``--fsdp2`` also clips the model wrapped by FSDP2's fully_shard in a world of one (its gradients DTensors), where
torch's own clipping is not a choice for twinkle (DTensors of several meshes). Ratios, not absolute times, are the
result: the CPU cannot show a GPU's launch costs, which is where one kernel per group saves most.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench_io import command_line, write_results  # noqa: E402


def build_model(args, dtype):
    """A module whose parameters are ``args.small`` small tensors and ``args.big`` big matrices."""
    import torch
    from torch import nn

    class Holder(nn.Module):
        def __init__(self, shape):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(shape, dtype=dtype, device=args.device) * 0.02)

    model = nn.Module()
    model.small = nn.ModuleList(Holder((args.small_size,)) for _ in range(args.small))
    model.big = nn.ModuleList(Holder((args.big_rows, args.big_cols)) for _ in range(args.big))
    return model


def fill_grads(model, seed: int) -> None:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        grad = torch.randn(local.shape, generator=generator).to(device=local.device, dtype=local.dtype)
        p.grad = grad if not hasattr(p, "to_local") else type(p).from_local(grad, p.device_mesh, p.placements,
                                                                            shape=p.shape, stride=p.stride())


def per_parameter_clip(model, max_norm: float, norm_type: float = 2.0):
    """twinkle_strategy's clip_grad_norm_ before the foreach kernels (world of one): a norm and a multiply per
    gradient."""
    import torch

    from twinkle_strategy.distributed.dtensor import local_tensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.zeros((), device=local_tensor(grads[0]).device, dtype=torch.float32)
    for g in grads:
        total += torch.linalg.vector_norm(local_tensor(g).detach().float(), norm_type) ** norm_type
    total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef.to(local_tensor(g).dtype))
    return total


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, *, steps: int, device: str) -> float:
    """Seconds per call of ``step`` (one warm-up call first)."""
    step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def methods_for(args, dtype, mesh) -> dict[str, dict]:
    """Group -> method -> a step to time, each on its own copy of the model (same values)."""
    import torch

    from twinkle_strategy.distributed.grad_clip import clip_grad_norm_

    def model_with_grads(wrapped: bool):
        torch.manual_seed(0)
        model = build_model(args, dtype)
        if wrapped:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
        fill_grads(model, seed=1)
        return model

    def adamw(**kind):
        model = model_with_grads(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **kind)
        return optimizer.step

    def clip(function, wrapped: bool):
        model = model_with_grads(wrapped)
        # max_norm far below the norm: every call scales every gradient (by a factor that keeps them finite).
        return lambda: function(model, 1e-3)

    groups = {
        "optimizer": {"adamw foreach": adamw(foreach=True), "adamw fused": adamw(fused=True)},
        "clip (plain tensors)": {
            "clip per parameter": clip(per_parameter_clip, False),
            "clip foreach": clip(clip_grad_norm_, False),
            "torch clip_grad_norm_": clip(lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n), False)},
    }
    if mesh is not None:
        groups["clip (FSDP2 DTensors, world of one)"] = {
            "clip per parameter": clip(per_parameter_clip, True), "clip foreach": clip(clip_grad_norm_, True)}
    return groups


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    mesh = None
    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
        mesh = init_device_mesh(args.device, (1,))
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        groups = methods_for(args, dtype, mesh)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeat):
            for group, methods in groups.items():
                for name, step in methods.items():
                    times.setdefault((group, name), []).append(time_steps(step, steps=args.steps, device=args.device))
        for group, methods in groups.items():
            first = statistics.median(times[(group, next(iter(methods)))])
            for name in methods:
                seconds = statistics.median(times[(group, name)])
                rows.append({"dtype": dtype_name, "group": group, "method": name, "ms": 1e3 * seconds,
                             "ratio": seconds / first, "rounds_ms": [1e3 * t for t in times[(group, name)]]})
    if args.fsdp2:
        dist.destroy_process_group()
    return {"rows": rows}


def render(result: dict, args, elements: int) -> str:
    lines = [f"Command: `{command_line('optimizer_bench.py')}`; device {args.device}, torch {result['torch']}, "
             f"{args.threads} thread(s); {args.small} tensors of {args.small_size} elements and {args.big} of "
             f"{args.big_rows} x {args.big_cols} ({elements / 1e6:.1f} M parameters); median of {args.repeat} "
             f"rounds of {args.steps} steps", "",
             "| dtype | what | method | ms per step | vs the first of its group |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['dtype']} | {row['group']} | {row['method']} | {row['ms']:.2f} | "
                     f"{row['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--small", type=int, default=600, help="small tensors (norms, biases, routers)")
    parser.add_argument("--small-size", type=int, default=1024, help="elements of each small tensor")
    parser.add_argument("--big", type=int, default=4, help="big matrices")
    parser.add_argument("--big-rows", type=int, default=1024)
    parser.add_argument("--big-cols", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (the median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-fsdp2", dest="fsdp2", action="store_false",
                        help="skip clipping FSDP2's DTensor gradients (a world of one)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    if args.quick:
        args.small, args.big, args.big_rows, args.big_cols, args.steps, args.repeat = 50, 2, 128, 128, 2, 1
    import torch

    result = run(args)
    result["torch"] = torch.__version__
    elements = args.small * args.small_size + args.big * args.big_rows * args.big_cols
    text = render(result, args, elements)
    print(text)
    name = "optimizer_bench" if args.device == "cpu" else f"optimizer_bench_{args.device}"
    if not args.quick:
        write_results(args.out, name, text=text, payload={**result, "args": vars(args), "parameters": elements,
                                                          "command": command_line("optimizer_bench.py")})
    assert all(math.isfinite(row["ms"]) for row in result["rows"])


if __name__ == "__main__":
    main()
