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

With ``--training`` it measures checkpoints during training instead (``train.async_save``), synchronous
against asynchronous saves of the same run, full-parameter and LoRA, all in one launch (see :func:`training_main`):

    python benchmarks/save_bench.py --training --hidden 1024 --layers 4    # the reported run

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
from bench_io import command_line, record_rank, write_results  # noqa: E402

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

    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

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
    # A method that fails on one rank is a row of the table: the rank exits 0 so that the launch goes on.
    record_rank(lambda: run_method(args.worker, args.model, args.save_to, args.ep, args.bucket_mb,
                                   int(args.shard_mb * 2**20)),
                results_dir=args.results, prefix=f"{args.worker}-", method=args.worker, exit_code_on_error=0)


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


# ---------------------------------------------------------------- --training: sync against async saves
TRAINING_STEPS, TRAINING_SAVE_STEPS = 8, 2
DATASET = os.path.join(ROOT, "examples", "data", "demo_sft.jsonl")


def training_run(model_path: str, out: str, *, lora: bool, async_save: bool) -> dict:
    """One run of the demo recipe's trainer; per save, the seconds training was blocked and (async) the seconds its
    writer and rank 0's commit took; per step, its seconds and whether a background write was in flight."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
    from twinkle_strategy.train.trainer import Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, device_type="cpu",
                                  timeout_s=600)
    model = strategy.from_pretrained(model_path)
    if lora:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"]))
    args = TrainingArguments(output_dir=out, add_version=False, max_steps=TRAINING_STEPS,
                             save_steps=TRAINING_SAVE_STEPS, per_device_train_batch_size=2, logging_steps=100,
                             async_save=async_save, save_total_limit=2)
    trainer = Trainer(model=model, strategy=strategy, args=args,
                      train_dataset=SFTDataset.from_jsonl(DATASET, tokenizer, max_length=64),
                      data_collator=DataCollatorForSFT(tokenizer.pad_token_id))
    trainer.setup()
    steps, saves = [], []
    original_step, original_save = trainer.training_step, trainer.save

    def timed_step(step):
        start, overlapping = time.perf_counter(), trainer.checkpoints.in_flight is not None
        result = original_step(step)
        steps.append({"seconds": time.perf_counter() - start, "overlapping": overlapping})
        return result

    def timed_save(global_step):
        path = original_save(global_step)
        report = trainer.save_report
        saves.append({"blocked": report.seconds, "rss_growth": report.peak_rss_bytes - report.rss_before_bytes})
        return path

    trainer.training_step, trainer.save = timed_step, timed_save
    trainer.train()
    result = {"steps": steps[1:], "saves": saves,
              "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())}
    background = trainer.checkpoints.async_saves
    if background is not None:
        # Per save: this rank's writer, from its start (deferred files first) to its last fsync; rank 0's commit
        # (the adapter read back and written, trainer_state.json, fsync of the tree, the rename, rotation), and
        # when the checkpoint had its final name, counted from the start of the save.
        for entry, done in zip(saves, background.finished, strict=True):
            entry.update(writer=done.write.finished_at - done.write.started_at, commit=done.commit_seconds,
                         durable_after=None if done.durable_at is None else done.durable_at - done.started)
        result["staging_bytes"] = background.host_copies.allocated_bytes
    return result


def training_worker(args) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    result = {}
    for tuner in ("full", "lora"):
        for mode in ("sync", "async"):
            out = os.path.join(args.save_to, f"{tuner}-{mode}")
            result[f"{tuner}-{mode}"] = training_run(args.model, out, lora=tuner == "lora", async_save=mode == "async")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(out, ignore_errors=True)
    with open(os.path.join(args.results, f"training-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _per_save(runs: list[dict], key: str) -> list[float]:
    """``key`` of each save, on the slowest of the ranks that have it."""
    return [max(v for s in saves if (v := s.get(key)) is not None)
            for saves in zip(*(r["saves"] for r in runs), strict=True)]


def training_table(ranks: list[dict]) -> tuple[str, list[dict]]:
    """Per tuner: blocked and total seconds per save (slowest rank), host memory a save holds, step times."""
    rows = []
    for tuner in ("full", "lora"):
        sync, background = ([r[f"{tuner}-{mode}"] for r in ranks] for mode in ("sync", "async"))
        blocked = {"sync": _mean(_per_save(sync, "blocked")), "async": _mean(_per_save(background, "blocked"))}
        # A synchronous save is done when it returns (rank 0 renamed the directory). An asynchronous one is done once
        # its slowest writer has written and rank 0 has committed: the sum of its three parts, each on its slowest
        # rank (not counting the wait for the step boundary whose poll starts the commit, see durable_after).
        total_async = _mean(b + w + c for b, w, c in zip(_per_save(background, "blocked"), _per_save(background, "writer"),
                                                         _per_save(background, "commit"), strict=True))
        steps = {"sync": [s for r in sync for s in r["steps"]], "async": [s for r in background for s in r["steps"]]}
        rows.append({"tuner": tuner, "blocked_sync_s": blocked["sync"], "blocked_async_s": blocked["async"],
                     "blocked_ratio": blocked["async"] / blocked["sync"], "total_sync_s": blocked["sync"],
                     "total_async_s": total_async,
                     "writer_async_s": _mean(_per_save(background, "writer")),
                     "commit_async_s": _mean(_per_save(background, "commit")),
                     "durable_after_async_s": _mean(_per_save(background, "durable_after")),
                     "save_rss_growth_sync_mb": max(_per_save(sync, "rss_growth")) / 2**20,
                     "staging_async_mb": max(r["staging_bytes"] for r in background) / 2**20,
                     "step_s_sync": _mean(s["seconds"] for s in steps["sync"]),
                     "step_s_async_overlapping": _mean(s["seconds"] for s in steps["async"] if s["overlapping"]),
                     "step_s_async_other": _mean(s["seconds"] for s in steps["async"] if not s["overlapping"]),
                     "shard_mb": sync[0]["shard_bytes"] / 2**20})
    lines = ["| tuner | blocked per save: sync s | async s | async / sync | total save: sync s | async s "
             "| async: writers s | commit s | durable after s | host memory per save: sync MiB | async MiB "
             "| step s: sync run | async, overlapping a write | async, other |",
             "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['tuner']} | {r['blocked_sync_s']:.3f} | {r['blocked_async_s']:.3f} | "
                     f"{r['blocked_ratio']:.2f} | {r['total_sync_s']:.3f} | {r['total_async_s']:.3f} | "
                     f"{r['writer_async_s']:.3f} | {r['commit_async_s']:.3f} | {r['durable_after_async_s']:.3f} | "
                     f"{r['save_rss_growth_sync_mb']:.0f} | {r['staging_async_mb']:.0f} | {r['step_s_sync']:.3f} | "
                     f"{r['step_s_async_overlapping']:.3f} | {r['step_s_async_other']:.3f} |")
    return "\n".join(lines), rows


def training_main(args) -> None:
    """Sync against async saves in training, one model, 2 simulated nodes x 2 ranks, ep=2."""
    from twinkle_strategy.train.demo_model import prepare_demo_model
    from twinkle_strategy.train.launcher import run_simulated_nodes

    work = tempfile.mkdtemp(prefix="save_bench_training-")
    model = prepare_demo_model(os.path.join(work, "model"), DATASET, hidden_size=args.hidden,
                               intermediate_size=args.hidden, num_layers=args.layers)
    results = os.path.join(work, "results")
    os.makedirs(results)
    script = [os.path.abspath(__file__), "--worker", "training", "--model", model, "--save-to",
              os.path.join(work, "runs"), "--results", results]
    env = {"PYTHONPATH": ROOT + os.pathsep + HERE, "OMP_NUM_THREADS": "1", "TWINKLE_LOG_LEVEL": "WARNING",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    run = run_simulated_nodes(script, nnodes=2, nproc_per_node=2, timeout=args.timeout, env=env, log_dir=results)
    ranks = []
    for r in range(4):
        path = os.path.join(results, f"training-rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if len(ranks) != 4:
        raise SystemExit(f"the training benchmark failed (returncodes {run.returncodes}); logs in {results}")
    table, rows = training_table(ranks)
    command = command_line("save_bench.py")
    text = (f"Command: `{command}`\n\nModel: the demo's Qwen3-MoE at hidden {args.hidden}, "
            f"{args.layers} layers, 8 experts (fp32, {rows[0]['shard_mb']:.0f} MiB of parameters per rank); "
            f"2 simulated nodes x 2 ranks, ep=2, gloo on CPU, {os.cpu_count()} CPU cores; "
            f"{TRAINING_STEPS} steps, a save every {TRAINING_SAVE_STEPS} (the first step is left out of the step "
            f"times).\n\n{table}\n")
    print(text)
    write_results(args.out, "save_bench_training", text=text, payload={"command": command, "rows": rows, "ranks": ranks})


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
    p.add_argument("--training", action="store_true", help="sync against async saves during training")
    p.add_argument("--hidden", type=int, default=512, help="--training: the model's hidden size")
    p.add_argument("--layers", type=int, default=4, help="--training: the model's layers")
    args = p.parse_args()
    if args.worker == "training":
        return training_worker(args)
    if args.worker:
        return worker_main(args)
    if args.training:
        return training_main(args)
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
    command = command_line("save_bench.py")
    text = (f"Command: `{command}`\n\nModel: {shape['checkpoint_mb']:.0f} MiB fp32 Qwen3-MoE "
            f"({shape['layers']} layers, {shape['experts']} experts, hidden {shape['hidden']}), loaded from a "
            f"hub-layout checkpoint; {args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep={args.ep}, gloo "
            f"on CPU, {os.cpu_count()} CPU cores; files of at most {args.shard_mb:.0f} MiB.\n\n{markdown(rows)}\n")
    print(text)
    write_results(args.out, "save_bench", text=text, payload={"command": command, "checkpoint": shape, "rows": rows})


if __name__ == "__main__":
    main()
