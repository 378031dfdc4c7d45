"""Training-step time with routing replay (R3) on and off, in the same run.

    python benchmarks/replay_bench.py              # 2 simulated nodes x 2, ep=2, ~3 min here
    python benchmarks/replay_bench.py --quick      # smoke run

One launch (one torchrun agent per simulated node on 127.0.0.1, gloo on CPU), a randomly initialised
Qwen3-MoE (fp32) wrapped with NativeFSDPStrategy(ep_size=2), activation checkpointing of every decoder
layer, AdamW. Each rank trains on its own random tokens; the record replayed is the router's own choice
for the batch (R2's record, taken once before the timed steps), so both modes compute the same thing
and the difference is replay's own cost: the router wrapper, the weights recomputed at the replayed
ids, and the telemetry. Steps alternate off, on, off, on ... after one warm-up step of each; reported:
the median step time of each mode and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def worker(path: str, steps: int, rows: int, seq: int, out: str) -> None:
    import torch

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.fsdp import find_decoder_layers
    from twinkle_strategy.moe.recompute import apply_activation_checkpointing

    torch.set_num_threads(1)
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", device_type="cpu")
    model = strategy.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = strategy.wrap_model(model, optimizer)
    apply_activation_checkpointing(find_decoder_layers(model))
    model.train()
    g = torch.Generator().manual_seed(strategy.rank)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=g)
    with torch.no_grad(), strategy.routing_record() as recorder:
        model(input_ids=ids)
    record = recorder.routed_experts(like=ids)

    def one_step(replay: bool) -> float:
        start = time.perf_counter()
        if replay:
            with strategy.routing_replay(record, input_ids=ids):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        strategy.take_routing_agreement()
        return time.perf_counter() - start

    one_step(False), one_step(True)  # warm-up (optimizer state)
    times = {"off": [], "on": []}
    for _ in range(steps):
        times["off"].append(one_step(False))
        times["on"].append(one_step(True))
    if strategy.rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    strategy.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", nargs=5, metavar=("PATH", "STEPS", "ROWS", "SEQ", "OUT"))
    args = p.parse_args()
    if args.worker:
        path, steps, rows, seq, out = args.worker
        worker(path, int(steps), int(rows), int(seq), out)
        return

    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint
    from twinkle_strategy.train.launcher import run_simulated_nodes

    steps, rows, seq, hidden = (2, 2, 32, 64) if args.quick else (8, 4, 256, 256)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        save_tiny_checkpoint("qwen3_moe", path, seed=0, vocab_size=1024, num_experts=16, hidden_size=hidden,
                             intermediate_size=hidden // 2, num_layers=4)
        out = os.path.join(tmp, "times.json")
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
        result = run_simulated_nodes([os.path.abspath(__file__), "--worker", path, str(steps), str(rows), str(seq),
                                      out], nnodes=2, nproc_per_node=2, timeout=1800, env=env, log_dir=tmp, cwd=ROOT)
        if result.timed_out or any(rc != 0 for rc in result.returncodes):
            for log in result.log_paths:
                print(open(log).read()[-4000:])
            raise SystemExit("the benchmark failed")
        with open(out) as f:
            times = json.load(f)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    report = {"off_s": round(off, 4), "on_s": round(on, 4), "ratio_on_off": round(on / off, 4),
              "steps_each": steps, "tokens_per_rank": rows * seq, "times": times}
    print(json.dumps(report, indent=1))
    if not args.quick:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", "replay_bench.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
