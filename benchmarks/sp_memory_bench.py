"""Ulysses sequence parallelism: activation memory per rank, and the longest sequence a memory budget holds.

    python benchmarks/sp_memory_bench.py                 # the reported run (1 node x 4 ranks, a few minutes here)
    python benchmarks/sp_memory_bench.py --quick         # smoke run

One torchrun agent with 4 ranks (gloo on CPU), a randomly initialised Qwen3-MoE (fp32, 4 query heads,
2 KV heads, 8 experts, ep_size=2), one row of random tokens. For sequence_parallel_size 1, 2 and 4:

* activation memory per rank: the bytes autograd keeps for the backward during one training forward of
  the same global sequence (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once,
  parameters excluded). This is the memory sequence parallelism divides; counting it rather than a
  process's RSS makes the figure the same on CPU, GPU and NPU and free of allocator noise.
* the longest sequence whose activations fit a fixed per-rank budget: the budget is what sp=1 needs for
  ``--length`` tokens; the length is searched in steps of 256 tokens.

Reported as ratios against sp=1 in the same run. Written to benchmarks/results/sp_memory_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SIZES = (1, 2, 4)
STEP = 256


def saved_activation_bytes(model, ids, strategy) -> int:
    """Bytes of the tensors autograd saves in one forward of ``ids`` (this rank's chunk), parameters excluded."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    chunk = strategy.split_sequence({"input_ids": ids, "labels": ids})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**chunk).loss
    loss.backward()  # (the backward runs, so that every rank's collectives pair up)
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {sp: {"bytes_at_length": _measure_with(sp, args.length, args)} for sp in SIZES}
    budget = results[1]["bytes_at_length"]
    for sp in SIZES:
        results[sp]["longest_within_budget"] = _longest(lambda n, sp=sp: _measure_with(sp, n, args), budget,
                                                        start=args.length)
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump({"length": args.length, "budget_bytes": budget, "sizes": results}, f, indent=1)


_MODELS: dict = {}


def _measure_with(sp: int, length: int, args) -> int:
    import torch
    import torch.distributed as dist

    from twinkle_strategy import NativeFSDPStrategy

    if sp not in _MODELS:
        strategy = NativeFSDPStrategy(ep_size=2, sequence_parallel_size=sp, mixed_precision="no", device_type="cpu")
        model, _ = strategy.wrap_model(strategy.from_pretrained(args.model, attn_implementation="sdpa"))
        model.train()
        _MODELS.clear()
        _MODELS[sp] = (strategy, model)
    strategy, model = _MODELS[sp]
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(length))
    mine = torch.tensor(saved_activation_bytes(model, ids, strategy))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine)


def _longest(measure, budget: int, *, start: int) -> int:
    """The longest multiple of STEP tokens whose activations fit ``budget`` (they grow with the length)."""
    fits, too_long = start, None
    while too_long is None:  # double until it no longer fits
        if measure(2 * fits) <= budget:
            fits *= 2
        else:
            too_long = 2 * fits
    while too_long - fits > STEP:  # then bisect
        middle = (fits + too_long) // 2 // STEP * STEP
        if measure(middle) <= budget:
            fits = middle
        else:
            too_long = middle
    return fits


def render(data: dict) -> str:
    one = data["sizes"]["1"]
    lines = [
        "# Ulysses: activation memory per rank (1 node x 4 ranks, ep_size=2, fp32)", "",
        f"Global sequence length {data['length']} tokens, one row; budget = what sp=1 needs for it "
        f"({data['budget_bytes'] / 2**20:.1f} MiB).", "",
        "| sequence_parallel_size | activation MiB per rank | vs sp=1 | longest sequence within the budget | vs sp=1 |",
        "|---|---|---|---|---|",
    ]
    for sp, row in data["sizes"].items():
        lines.append(f"| {sp} | {row['bytes_at_length'] / 2**20:.1f} | "
                     f"{row['bytes_at_length'] / one['bytes_at_length']:.2f}x | {row['longest_within_budget']} | "
                     f"{row['longest_within_budget'] / one['longest_within_budget']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint
    from twinkle_strategy.train.launcher import run_simulated_nodes

    if args.quick:
        args.length, args.hidden = 512, 64
    out_dir = os.path.join(HERE, "results")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        save_tiny_checkpoint("qwen3_moe", model, seed=0, vocab_size=1024, num_experts=8, hidden_size=args.hidden,
                             intermediate_size=args.hidden // 2, num_layers=2, max_position_embeddings=1 << 17)
        results = os.path.join(tmp, "results.json")
        run = run_simulated_nodes([os.path.abspath(__file__), "--worker", "--model", model, "--results", results,
                                   "--length", str(args.length)], nnodes=1, nproc_per_node=4, timeout=3600,
                                  env={"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, log_dir=tmp, cwd=ROOT)
        if run.returncodes != [0]:
            sys.exit(f"benchmark failed: {run.returncodes}\n" + open(run.log_paths[0]).read()[-4000:])
        with open(results) as f:
            data = json.load(f)
    data["command"] = "python benchmarks/sp_memory_bench.py" + (" --quick" if args.quick else "")
    name = "sp_memory_bench_quick" if args.quick else "sp_memory_bench"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    table = render(data)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + f"\nReproduce: `{data['command']}`\n")
    print(table)


if __name__ == "__main__":
    main()
