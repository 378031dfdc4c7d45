"""Weight export to a rollout engine: strategy.export_weights against gathering the model first, same run.

    python benchmarks/export_bench.py                      # the reported run: ~225 MB Qwen3-MoE, 2 nodes x 2, ep=2
    python benchmarks/export_bench.py --hidden 256 --layers 2   # a smoke run

One launch (one torchrun agent per simulated node on 127.0.0.1, gloo on CPU, fp32). The model is loaded with
memory_efficient_init from a Qwen3-MoE checkpoint in the hub layout and wrapped with EP + FSDP2. Rank 0 is the
destination: it forwards what it gets to a receiver process outside the group (export_receiver-like: it reads
the bytes and drops them), so every method ends with the same send. In turn, in the same processes:

  ours          strategy.export_weights(bucket_bytes=32 MiB).send_to(ProcessSender): each rank sends its own rows
                to rank 0 bucket by bucket, rank 0 forwards each bucket in the checkpoint's layout
  rank0_gather  strategy.full_state_dict(rank0_only=True) (every region sent to rank 0 once), then rank 0 sends the
                whole state dict (the model's own layout) to the receiver in one go
  full_tensor   gather_full_state_dict on every rank (DTensor.full_tensor + EP all-gather, what a naive sync
                does), then rank 0 sends it

Per rank: seconds, tensor bytes received (torch.distributed calls counted as in init_bench.py), and the peak of
tensor storages the method allocated and held at once (a dispatch mode: tests/workers/alloc_tracker.py).
Writes benchmarks/results/export_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))

METHODS = ("ours", "rank0_gather", "full_tensor")
BUCKET = 32 * 2**20


def receiver_main(address: str, authkey: str) -> None:
    """The process outside the group: receives exports and drops the bytes."""
    from twinkle_strategy.rl.receivers import serve_export

    host, port = address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=authkey.encode())
    while connection.recv()[0] == "export":
        serve_export(connection, lambda bucket: None)


def run_method(method: str, strategy, model, sender) -> dict:
    import torch.distributed as dist
    from alloc_tracker import LiveBytes
    from init_bench import Counter

    from twinkle_strategy.rl.weight_export import Bucket
    from twinkle_strategy.shards.gather import gather_full_state_dict

    counter, tracker = Counter(), LiveBytes()
    counter.install()
    counter.uncounted_barrier()
    counter.calls, counter.bytes_received = 0, 0
    tracker.mark()
    start = time.perf_counter()
    report = None
    with tracker:
        if method == "ours":
            report = strategy.export_weights(model, bucket_bytes=BUCKET).send_to(sender)
        else:
            state = (strategy.full_state_dict(model, rank0_only=True) if method == "rank0_gather"
                     else gather_full_state_dict(model, strategy.ep_plan))
            if sender is not None:
                sender.prepare([])
                sender(Bucket(0, 0, list(state.items()), 0))
                sender.finish()
            del state
            dist.barrier()
    seconds = time.perf_counter() - start
    counts = counter.snapshot()
    counter.uninstall()
    out = {"method": method, "rank": strategy.rank, "seconds": seconds, "bytes_received": counts["bytes_received"],
           "tensor_peak_bytes": tracker.extra_peak}
    if report is not None:
        mine = report.ranks[strategy.rank]
        out.update(bytes_sent=mine.bytes_sent, buckets=report.buckets, largest_bucket=report.largest_bucket_bytes,
                   seconds_blocked=mine.seconds_blocked, log_line=report.log_line())
    return out


def worker_main(args) -> None:
    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.rl.receivers import ProcessSender

    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, device_type="cpu",
                                  timeout_s=900)
    model, _ = strategy.wrap_model(strategy.from_pretrained(args.model))
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    sender = process = None
    if strategy.rank == 0:
        authkey = secrets.token_hex(8)
        listener = Listener(("127.0.0.1", 0), authkey=authkey.encode())
        host, port = listener.address
        process = subprocess.Popen([sys.executable, __file__, "--receiver", f"{host}:{port}", authkey])
        connection = listener.accept()
        sender = ProcessSender(connection)
    results = []
    for method in METHODS:
        if sender is not None:
            sender.connection.send(("export",))
        results.append({**run_method(method, strategy, model, sender), "shard_bytes": shard})
    if sender is not None:
        sender.connection.send(("quit",))
        process.wait(timeout=60)
    with open(os.path.join(args.results, f"rank{strategy.rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)


def table(ranks: list[list[dict]], model_bytes: int) -> str:
    lines = [f"Model: {model_bytes / 2**20:.0f} MiB (fp32), 2 nodes x 2 ranks, ep=2, gloo on loopback; "
             f"buckets of {BUCKET // 2**20} MiB.", "",
             "| method | seconds (slowest rank) | MiB received, rank 0 | MiB received, max other rank "
             "| peak extra tensor MiB, rank 0 | peak extra tensor MiB, max other rank |", "|---|---|---|---|---|---|"]
    for i, method in enumerate(METHODS):
        rows = [r[i] for r in ranks]
        zero, others = rows[0], rows[1:]
        lines.append(f"| {method} | {max(r['seconds'] for r in rows):.2f} | {zero['bytes_received'] / 2**20:.0f} "
                     f"| {max(r['bytes_received'] for r in others) / 2**20:.0f} "
                     f"| {zero['tensor_peak_bytes'] / 2**20:.0f} "
                     f"| {max(r['tensor_peak_bytes'] for r in others) / 2**20:.0f} |")
    ours = [r[0] for r in ranks]
    lines += ["", "full_tensor's FSDP all-gathers run through torch's functional collectives, which the counter does not "
              "see (only its EP all-gathers are counted); its peak shows the whole model on every rank.", "", "ours, MiB sent per rank: " + ", ".join(f"r{r['rank']} {r['bytes_sent'] / 2**20:.0f}" for r in ours)
              + f"; shard per rank {ours[0]['shard_bytes'] / 2**20:.0f} MiB", "", "`" + ours[0]["log_line"] + "`"]
    return "\n".join(lines)


def main() -> None:
    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint
    from twinkle_strategy.train.launcher import run_simulated_nodes

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_checkpoint("qwen3_moe", os.path.join(tmp, "model"), hidden_size=args.hidden,
                                     intermediate_size=args.hidden, num_layers=args.layers, max_shard_size="50MB")
        model_bytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                          if f.endswith(".safetensors"))
        results = os.path.join(tmp, "results")
        os.makedirs(results)
        os.makedirs(os.path.join(tmp, "logs"))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
        run = run_simulated_nodes([__file__, "--worker", "--model", model, "--results", results], nnodes=2,
                                  nproc_per_node=2, timeout=1800, env=env, log_dir=os.path.join(tmp, "logs"), cwd=ROOT)
        if run.timed_out or any(rc != 0 for rc in run.returncodes):
            for path in run.log_paths:
                print(open(path).read()[-4000:])
            raise SystemExit(f"the launch failed: {run.returncodes}")
        ranks = [json.load(open(os.path.join(results, f"rank{r}.json"))) for r in range(4)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "export_bench.json"), "w") as f:
        json.dump({"model_bytes": model_bytes, "ranks": ranks}, f, indent=1)
    text = table(ranks, model_bytes)
    with open(os.path.join(args.out, "export_bench.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        receiver_main(sys.argv[2], sys.argv[3])
    elif "--worker" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", action="store_true")
        parser.add_argument("--model")
        parser.add_argument("--results")
        worker_main(parser.parse_args())
    else:
        main()
