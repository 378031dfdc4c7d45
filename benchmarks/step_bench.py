"""Training-step throughput and memory: FSDP2 + EP (with and without activation checkpointing) vs plain FSDP2.

    python benchmarks/step_bench.py --repeat 3     # the reported run (2 nodes x 2, ~20 min here)
    python benchmarks/step_bench.py --quick        # smoke run

Each method runs in fresh processes (one torchrun agent per simulated node on 127.0.0.1, gloo on
CPU) on the same randomly initialised Qwen3-MoE model (fp32) and the same global batch of random
tokens (every rank its own part), with AdamW:

  ours_ep2, ours_ep4        NativeFSDPStrategy(ep_size=2 / 4): experts split across EP ranks, all-to-all
                            dispatch, experts on the ep_fsdp mesh, layers and root on the flat mesh
  ours_ep2_ac, ours_ep4_ac  the same with activation checkpointing of every decoder layer, the EP
                            dispatch replayed in the recomputation (twinkle_strategy.moe.recompute)
  fsdp2                     what users pick instead: transformers' model with torch's fully_shard per
                            decoder layer and on the root (accelerate's FSDP2 plugin does the same), no
                            EP: every rank runs every expert on its own tokens

Reported per method: global tokens per second (median of the timed steps), and per rank the peak RSS
growth during the timed steps over the RSS before them (activations, gradients, gathered parameters,
optimizer transients; the maximum over ranks), and the peak RSS. A warm-up step (which creates the
optimizer state) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench_io import command_line, record_rank, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

METHODS = ("fsdp2", "ours_ep2", "ours_ep2_ac", "ours_ep4", "ours_ep4_ac")


def build_model(path: str, *, hidden: int, layers: int, experts: int) -> dict:
    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("qwen3_moe", path, seed=0, vocab_size=1024, num_experts=experts, hidden_size=hidden,
                         intermediate_size=hidden // 2, num_layers=layers)
    return {"hidden": hidden, "layers": layers, "experts": experts}


def plain_fsdp2(path: str):
    """transformers' model, fully_shard per decoder layer and on the root: FSDP2 without EP."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.fsdp import find_decoder_layers

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in find_decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def ours(path: str, ep: int, checkpointing: bool):
    import torch

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.fsdp import find_decoder_layers
    from twinkle_strategy.moe.recompute import apply_activation_checkpointing

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", device_type="cpu", timeout_s=600)
    model = strategy.from_pretrained(path, dtype=torch.float32)
    if checkpointing:
        apply_activation_checkpointing(find_decoder_layers(model))
    model, _ = strategy.wrap_model(model)
    return model


def run_method(method: str, path: str, *, seq: int, batch: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from twinkle_strategy.distributed.runtime import peak_rss_since_reset, reset_peak_rss, rss_bytes

    if method == "fsdp2":
        model = plain_fsdp2(path)
    else:
        ep = int(method.split("_ep")[1][0])
        model = ours(path, ep, method.endswith("_ac"))
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
    model.train()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state, first gathers
    dist.barrier()
    rss_before = rss_bytes()
    reset_peak_rss()
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return {"method": method, "rank": rank, "seconds": seconds, "tokens_per_step": batch * seq * world,
            "rss_before": rss_before, "peak_rss": peak_rss_since_reset()}


def worker_main(args) -> None:
    # A method that fails is a row of the table: the rank exits 0 so that the launch goes on.
    record_rank(lambda: run_method(args.worker, args.model, seq=args.seq, batch=args.batch, steps=args.steps),
                results_dir=args.results, prefix=f"{args.worker}-", method=args.worker, exit_code_on_error=0)


def summarize(method: str, ranks: list[dict]) -> dict:
    errors = sorted({r["error"] for r in ranks if r.get("error")})
    if errors or not ranks:
        return {"method": method, "status": "FAILED: " + "; ".join(errors or ["no result"])}
    step_s = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(len(ranks[0]["seconds"])))
    return {"method": method, "status": "ok", "step_s": step_s, "tokens_per_s": ranks[0]["tokens_per_step"] / step_s,
            "growth_mb_max": max(r["peak_rss"] - r["rss_before"] for r in ranks) / 2**20,
            "peak_mb_max": max(r["peak_rss"] for r in ranks) / 2**20}


def markdown(rows: list[dict]) -> str:
    base = next((r for r in rows if r["method"] == "fsdp2" and "step_s" in r), None)
    lines = ["| method | tokens/s | vs fsdp2 | step s | peak RSS growth in the step, MiB (max rank) "
             "| vs fsdp2 | peak RSS MiB (max rank) |", "|" + "---|" * 7]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * 5)
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        memory = f"{r['growth_mb_max'] / base['growth_mb_max']:.2f}x" if base else "-"
        low, high = r.get("step_s_range", [r["step_s"]] * 2)
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.0f} | {speed} | {r['step_s']:.2f} ({low:.2f}-{high:.2f}) "
                     f"| {r['growth_mb_max']:.0f} | {memory} | {r['peak_mb_max']:.0f} |")
    return "\n".join(lines)


def run_all(args, work: str, model: str) -> list[dict]:
    """Every method ``--repeat`` times, in rounds (a busy machine slows all methods alike, not one); per
    method the round with the fastest step is kept, with the range of step times."""
    rounds = [run_round(args, work, model, index) for index in range(args.repeat)]
    rows = []
    for position, _method in enumerate(args.methods.split(",")):
        runs = [r[position] for r in rounds]
        done = [r for r in runs if "step_s" in r]
        best = min(done, key=lambda r: r["step_s"]) if done else runs[0]
        if done:
            best = {**best, "step_s_range": [min(r["step_s"] for r in done), max(r["step_s"] for r in done)]}
        rows.append(best)
    return rows


def run_round(args, work: str, model: str, index: int) -> list[dict]:
    from twinkle_strategy.train.launcher import run_simulated_nodes

    rows = []
    for method in args.methods.split(","):
        results = os.path.join(work, f"results-{method}-{index}")
        os.makedirs(results)
        script = [os.path.abspath(__file__), "--worker", method, "--model", model, "--results", results,
                  "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
        env = {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TWINKLE_LOG_LEVEL": "WARNING",
               "TRANSFORMERS_VERBOSITY": "error"}
        print(f"running {method}...", flush=True)
        run_simulated_nodes(script, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, timeout=args.timeout,
                            env=env, log_dir=results)
        ranks = []
        for r in range(args.nnodes * args.nproc_per_node):
            path = os.path.join(results, f"{method}-rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        rows.append(summarize(method, ranks))
        print(f"  {rows[-1]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1, help="rounds over all methods; the fastest round is kept")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    if args.quick:
        args.hidden, args.layers, args.seq, args.batch, args.steps = 64, 2, 32, 2, 2
    work = tempfile.mkdtemp(prefix="step_bench-")
    model = os.path.join(work, "model")
    shape = build_model(model, hidden=args.hidden, layers=args.layers, experts=args.experts)
    rows = run_all(args, work, model)
    shutil.rmtree(work, ignore_errors=True)
    command = command_line("step_bench.py")
    text = (f"Command: `{command}`\n\nModel: Qwen3-MoE fp32, {shape['layers']} layers, {shape['experts']} "
            f"experts (top-2), hidden {shape['hidden']}; global batch {args.batch} x {args.nnodes * args.nproc_per_node}"
            f" ranks x {args.seq} tokens; {args.nnodes} simulated nodes x {args.nproc_per_node} ranks, gloo on CPU, "
            f"{os.cpu_count()} CPU cores; median of {args.steps} timed steps, fastest of {args.repeat} round(s) "
            f"(step s: that round, then the range over rounds).\n\n{markdown(rows)}\n")
    print(text)
    write_results(args.out, "step_bench", text=text, payload={"command": command, "model": shape, "rows": rows})


if __name__ == "__main__":
    main()
