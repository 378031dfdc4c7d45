"""Saving a full-parameter FSDP2 + EP model as a Hugging Face checkpoint: this project against the alternatives.

    python benchmarks/save_bench.py --model-mb 1200 --shard-mb 200      # the reported run (2 nodes x 2, ep=2)
    python benchmarks/save_bench.py --quick                            # ~20 MB smoke run

Each method runs in fresh processes (one torchrun agent per simulated node on 127.0.0.1, gloo on
CPU), on the same model, loaded with memory_efficient_init from a synthetic Qwen3-MoE checkpoint in
the hub layout (per-expert keys) and sharded with EP + FSDP2:

  ours          NativeFSDPStrategy.save_pretrained: every rank writes the rows it keeps straight into
                the final safetensors files, in the source checkpoint's key layout; nothing is gathered
  rank0_gather  what this project did before: strategy.full_state_dict(rank0_only=True) (every tensor
                all-gathered, EP slices joined) and global rank 0 calls transformers' save_pretrained
  dcp           torch DCP: dcp.save(model.state_dict(), HuggingFaceStorageWriter(save_distributed=True))
                (each rank writes its shards to its own files), then
                consolidate_safetensors_files_on_every_rank (each rank assembles some of the final files)

Every method is then checked: rank 0 loads the written checkpoint with plain from_pretrained
(missing or unexpected keys make it WRONG) and compares every tensor with the model gathered in
memory, bit for bit; and the file's keys are compared with the source checkpoint's (hub layout).
Bytes received are counted by wrapping torch.distributed's functions (see init_bench.py); peak RSS
growth is VmHWM after resetting it at the start of the save, minus RSS before the save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

METHODS = ("ours", "rank0_gather", "dcp")


def save_with(method: str, strategy, model, out: str, max_file_bytes: int) -> None:
    import torch.distributed as dist

    if method == "ours":
        strategy.save_pretrained(model, out, max_shard_size=max_file_bytes)
    elif method == "rank0_gather":
        state = strategy.full_state_dict(model, rank0_only=True)
        if strategy.rank == 0:
            model.save_pretrained(out, state_dict=state, max_shard_size=max_file_bytes)
        del state
        dist.barrier()
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files_on_every_rank,
        )

        state = model.state_dict()
        # One output file per ~max_file_bytes of tensors, like save_pretrained.
        mapping, size, index = {}, 0, 1
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > max_file_bytes:
                index, size = index + 1, 0
            mapping[name], size = index, size + nbytes
        sharded = os.path.join(out, "sharded")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(sharded, save_distributed=True))
        dist.barrier()
        consolidate_safetensors_files_on_every_rank(sharded, out, mapping)
        dist.barrier()
        if strategy.rank == 0:
            shutil.rmtree(sharded, ignore_errors=True)
            model.config.save_pretrained(out)
    else:
        raise ValueError(method)


def run_method(method: str, path: str, out: str, ep: int, bucket_mb: float, max_file_bytes: int) -> dict:
    import torch.distributed as dist
    from init_bench import Counter

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.distributed.runtime import peak_rss_since_reset, reset_peak_rss, rss_bytes

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=bucket_mb, device_type="cpu", timeout_s=600)
    model, _ = strategy.wrap_model(strategy.from_pretrained(path))
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    if strategy.rank == 0:
        os.makedirs(out, exist_ok=True)
    counter = Counter()
    counter.install()
    dist.barrier()
    counter.calls, counter.bytes_received, counter.by_name = 0, 0, {}
    rss_before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    error = None
    try:
        save_with(method, strategy, model, out, max_file_bytes)
    except BaseException as exc:  # noqa: BLE001 - a method that fails is a result too
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        error = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
    seconds = time.perf_counter() - start
    peak = peak_rss_since_reset()
    counts = counter.snapshot()
    counter.uninstall()
    result = {"method": method, "rank": strategy.rank, "seconds": seconds, "bytes_received": counts["bytes_received"],
              "collective_calls": counts["calls"], "shard_bytes": shard_bytes, "rss_before": rss_before,
              "peak_rss": peak, "error": error}
    dist.barrier()
    # Correctness, outside the timed save: the checkpoint against the model gathered in memory.
    state = strategy.full_state_dict(model, rank0_only=True)
    if strategy.rank == 0 and error is None:
        result.update(check_checkpoint(out, path, state))
    return result


def check_checkpoint(out: str, source: str, gathered: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.checkpoint.files import SafetensorsIndex

    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True,
                                                            ignore_mismatched_sizes=True)
    except Exception as exc:  # noqa: BLE001
        return {"status": f"FAILED to load: {type(exc).__name__}: {str(exc)[:150]}"}
    state = loaded.state_dict()
    wrong = sorted(k for k in gathered if k not in state or not torch.equal(state[k], gathered[k]))
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    mismatched = sorted(info.get("mismatched_keys", []))
    same_keys = set(SafetensorsIndex.from_directory(out).tensors) == set(SafetensorsIndex.from_directory(source).tensors)
    parts = []
    if missing or unexpected:
        parts.append(f"{len(missing)} missing, {len(unexpected)} unexpected keys on load")
    if mismatched:
        key, saved, expected = mismatched[0]
        parts.append(f"{len(mismatched)} tensors of the wrong shape (e.g. {key}: {tuple(saved)}, the model has "
                     f"{tuple(expected)})")
    if wrong:
        parts.append(f"{len(wrong)} tensors differ (e.g. {wrong[0]})")
    status = "WRONG: " + "; ".join(parts) if parts else "correct"
    return {"status": status, "hub_layout": same_keys}


def worker_main(args) -> None:
    try:
        result = run_method(args.worker, args.model, args.save_to, args.ep, args.bucket_mb,
                            int(args.shard_mb * 2**20))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        result = {"method": args.worker, "rank": int(os.environ["RANK"]), "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    with open(os.path.join(args.results, f"{args.worker}-rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def summarize(method: str, ranks: list[dict]) -> dict:
    errors = sorted({r["error"] for r in ranks if r.get("error")})
    if errors or not ranks:
        return {"method": method, "status": "FAILED: " + "; ".join(errors or ["no result"])}
    rank0 = next(r for r in ranks if r["rank"] == 0)
    return {
        "method": method, "status": rank0.get("status", "?"), "hub_layout": rank0.get("hub_layout"),
        "save_s": max(r["seconds"] for r in ranks),
        "recv_over_shard_max": max(r["bytes_received"] / r["shard_bytes"] for r in ranks),
        "recv_mb_max": max(r["bytes_received"] for r in ranks) / 2**20,
        "rss_growth_over_shard_max": max((r["peak_rss"] - r["rss_before"]) / r["shard_bytes"] for r in ranks),
        "rss_growth_mb_max": max(r["peak_rss"] - r["rss_before"] for r in ranks) / 2**20,
        "rss_peak_mb_max": max(r["peak_rss"] for r in ranks) / 2**20,
        "calls_max": max(r["collective_calls"] for r in ranks),
        "per_rank": [{k: r[k] for k in ("rank", "seconds", "bytes_received", "shard_bytes", "rss_before", "peak_rss")}
                     for r in sorted(ranks, key=lambda r: r["rank"])],
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| method | result | source's key layout | save s | received / shard (max rank) | received MiB (max) "
             "| peak RSS growth / shard (max rank) | peak RSS growth MiB (max) | peak RSS MiB (max) "
             "| collective calls (max) |", "|" + "---|" * 10]
    for r in rows:
        if "save_s" not in r:
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * 8)
            continue
        lines.append(f"| {r['method']} | {r['status']} | {'yes' if r['hub_layout'] else 'no'} | {r['save_s']:.2f} "
                     f"| {r['recv_over_shard_max']:.2f} | {r['recv_mb_max']:.0f} | {r['rss_growth_over_shard_max']:.2f} "
                     f"| {r['rss_growth_mb_max']:.0f} | {r['rss_peak_mb_max']:.0f} | {r['calls_max']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=200)
    p.add_argument("--shard-mb", type=float, default=100, help="max size of each safetensors file")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--save-to", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    from init_bench import build_checkpoint

    from twinkle_strategy.train.launcher import run_simulated_nodes

    work = tempfile.mkdtemp(prefix="save_bench-")
    model = os.path.join(work, "model")
    shape = build_checkpoint(20 if args.quick else args.model_mb, model, args.shard_mb)
    print(f"checkpoint: {shape} (work dir {work})", flush=True)
    rows = []
    for method in args.methods.split(","):
        results = os.path.join(work, f"results-{method}")
        os.makedirs(results)
        script = [os.path.abspath(__file__), "--worker", method, "--model", model, "--save-to",
                  os.path.join(work, f"saved-{method}"), "--results", results, "--ep", str(args.ep),
                  "--bucket-mb", str(args.bucket_mb), "--shard-mb", str(args.shard_mb)]
        env = {"PYTHONPATH": ROOT + os.pathsep + HERE, "OMP_NUM_THREADS": "1", "TWINKLE_LOG_LEVEL": "WARNING",
               "TRANSFORMERS_VERBOSITY": "error"}
        print(f"running {method}...", flush=True)
        run = run_simulated_nodes(script, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                                  timeout=args.timeout, env=env, log_dir=results)
        ranks = []
        for r in range(args.nnodes * args.nproc_per_node):
            path = os.path.join(results, f"{method}-rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        row = summarize(method, ranks if run.ok or ranks else [])
        print(f"  {row['status']}", flush=True)
        rows.append(row)
        shutil.rmtree(os.path.join(work, f"saved-{method}"), ignore_errors=True)
    command = "python benchmarks/save_bench.py " + " ".join(sys.argv[1:])
    text = (f"Command: `{command.strip()}`\n\nModel: {shape['checkpoint_mb']:.0f} MiB fp32 Qwen3-MoE "
            f"({shape['layers']} layers, {shape['experts']} experts, hidden {shape['hidden']}), loaded from a "
            f"hub-layout checkpoint; {args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep={args.ep}, gloo "
            f"on CPU, {os.cpu_count()} CPU cores; files of at most {args.shard_mb:.0f} MiB.\n\n{markdown(rows)}\n")
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "save_bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "save_bench.json"), "w") as f:
        json.dump({"command": command, "checkpoint": shape, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}/save_bench.md, .json")


if __name__ == "__main__":
    main()
