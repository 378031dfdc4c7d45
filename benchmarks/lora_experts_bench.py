"""LoRA on fused experts: one MoE layer's experts forward + backward, on the activations against PEFT's path.

    python benchmarks/lora_experts_bench.py                    # the reported run (CPU, ~1 min here)
    python benchmarks/lora_experts_bench.py --quick            # smoke run
    python benchmarks/lora_experts_bench.py --device cuda      # on a GPU (bf16; CUDA peak memory)

One process, one transformers ``Qwen3MoeExperts`` module (real class, sizes from the flags) with PEFT's LoRA on
``gate_up_proj`` and ``down_proj`` (``target_parameters``, r=8): the same tokens, routing and adapter for every
method. Methods: ``peft`` (PEFT's own forward: ``W + scale * BA`` formed per call) and ``activations``
(:mod:`twinkle_strategy.moe.lora_experts`), each under transformers' ``grouped_mm`` and ``eager`` experts
implementations. Figures:

* ms per forward + backward (median of ``--repeat`` after one warm-up);
* saved MiB: the bytes autograd keeps for the backward, unique storages that are no parameter's (a
  ``saved_tensors_hooks`` count: what the step's activations hold for this layer);
* peak MiB: the most tensor bytes the forward + backward made that were alive at once (CPU: counted by a
  dispatch mode, :func:`twinkle_strategy.compat.torch_internals.peak_tracked_bytes`; CUDA:
  ``max_memory_allocated`` above the start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_io import command_line, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIB = 2**20


class Layer(torch.nn.Module):
    """What holds the experts module (``experts``), as an MoE block does."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.experts = experts


def build(args, *, method: str, implementation: str) -> Layer:
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from twinkle_strategy.moe.lora_experts import compute_lora_on_activations

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, experts_implementation=implementation)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.02)
    layer = Layer(experts).to(device=args.device, dtype=args.dtype)
    torch.manual_seed(1)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=[], init_lora_weights=False,
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    layer = inject_adapter_in_model(lora, layer)
    for name, p in layer.named_parameters():
        p.requires_grad_("lora_" in name)
    if method == "activations":
        assert compute_lora_on_activations(layer) == ["experts"]
    return layer


def inputs(args):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(args.device, args.dtype)
    scores = torch.randn(args.tokens, args.experts, generator=g).softmax(-1)
    weights, index = scores.topk(args.top_k, dim=-1)
    return x.requires_grad_(), index.to(args.device), weights.to(args.device, args.dtype)


def step(layer, x, index, weights):
    out = layer.experts(x, index, weights)
    out.float().square().mean().backward()


def saved_bytes(layer, x, index, weights) -> int:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer.experts(x, index, weights)
    out.float().square().mean().backward()
    return sum(storages.values())


def peak_bytes(layer, x, index, weights) -> int:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(layer, x, index, weights)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from twinkle_strategy.compat import torch_internals as th

    return th.peak_tracked_bytes(lambda: step(layer, x, index, weights))


def timed_ms(layer, x, index, weights, repeat: int) -> float:
    step(layer, x, index, weights)  # warm-up
    times = []
    for _ in range(repeat):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(layer, x, index, weights)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(args, method: str, implementation: str) -> dict:
    layer = build(args, method=method, implementation=implementation)
    x, index, weights = inputs(args)
    row = dict(method=method, implementation=implementation,
               ms=timed_ms(layer, x, index, weights, args.repeat),
               saved_mib=saved_bytes(layer, x, index, weights) / MIB,
               peak_mib=peak_bytes(layer, x, index, weights) / MIB)
    x.grad = None
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512, help="the experts' intermediate size")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    if args.quick:
        args.hidden, args.inter, args.experts, args.tokens, args.repeat = 256, 128, 8, 256, 2
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rows = [measure(args, method, implementation) for implementation in ("grouped_mm", "eager")
            for method in ("peft", "activations")]
    stack_mib = args.experts * 3 * args.hidden * args.inter * torch.finfo(args.dtype).bits / 8 / MIB
    lines = [f"`{command_line('lora_experts_bench.py')}`: one Qwen3MoeExperts layer, {args.experts} experts, "
             f"hidden {args.hidden}, intermediate {args.inter}, top-{args.top_k}, {args.tokens} tokens, LoRA r={args.rank} "
             f"on gate_up_proj and down_proj, {str(args.dtype).removeprefix('torch.')} on {args.device}; the expert "
             f"weights are {stack_mib:.1f} MiB", "",
             "| experts implementation | method | ms fwd+bwd | saved for backward MiB | peak MiB |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['implementation']} | {r['method']} | {r['ms']:.1f} | {r['saved_mib']:.1f} | "
                     f"{r['peak_mib']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "lora_experts_bench" + ("_quick" if args.quick else ""), text=text,
                  payload=dict(command=command_line("lora_experts_bench.py"), rows=rows, stack_mib=stack_mib,
                               args={k: str(v) for k, v in vars(args).items()}))


if __name__ == "__main__":
    main()
