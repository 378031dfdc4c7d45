"""What a node's source holds beyond its receivers, and how long the init takes, at 2 and 4 ranks per node.

    python benchmarks/source_memory_bench.py --model-mb 600 --bucket-mb 32 --before dfc85fb

Runs ``ours_stream`` of init_bench.py (NativeFSDPStrategy(memory_efficient_init=True), streaming a
synthetic hub-layout Qwen3-MoE checkpoint, gloo on CPU, one simulated node) with this checkout's
``twinkle_strategy`` and with the one of git revision ``--before`` (extracted with ``git archive``),
alternating, ``--repeat`` times each. For each it reports the median of:

* (source - receiver) peak RSS / model: ``ru_maxrss`` of the node's source minus the largest of its
  receivers, over the checkpoint size (what the source holds beyond its shards: send pool buffers,
  chunks being read; the shards themselves are the same size on every rank);
* init s: ``from_pretrained`` + ``wrap_model`` on the slowest rank; distribute s: the transfer alone.

Before/after ratios are taken in the same run, on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import init_bench  # noqa: E402
from bench_io import command_line, write_results  # noqa: E402


def extract(revision: str, into: str) -> str:
    """``twinkle_strategy`` of ``revision``, unpacked under ``into`` (an importable root)."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "twinkle_strategy"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def launch(code_root: str, model: str, nproc: int, ep: int, bucket_mb: float, results: str, timeout: float) -> dict:
    from twinkle_strategy.train.launcher import run_simulated_nodes

    os.makedirs(results, exist_ok=True)
    script = [os.path.join(HERE, "init_bench.py"), "--worker", "ours_stream", "--model", model, "--ep", str(ep),
              "--bucket-mb", str(bucket_mb), "--results", results, "--collective-timeout", "300"]
    env = {"PYTHONPATH": code_root, "OMP_NUM_THREADS": "1", "TWINKLE_LOG_LEVEL": "WARNING",
           "TRANSFORMERS_VERBOSITY": "error"}
    result = run_simulated_nodes(script, nnodes=1, nproc_per_node=nproc, timeout=timeout, env=env, log_dir=results)
    ranks = []
    for rank in range(nproc):
        path = os.path.join(results, f"ours_stream-rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if not result.ok or len(ranks) != nproc or any("error" in r for r in ranks):
        errors = [r.get("error") for r in ranks if "error" in r]
        raise RuntimeError(f"launch in {results} failed: {errors or 'see its logs'}")
    if ranks[0]["wrong_tensors"] or ranks[0]["wrong_buffers"]:
        raise RuntimeError(f"launch in {results} loaded wrong weights: {ranks[0]['wrong_tensors'][:3]}")
    return measure(ranks)


def measure(ranks: list[dict]) -> dict:
    source = next(r for r in ranks if r["is_source"])
    receivers = [r for r in ranks if not r["is_source"]]
    model = source["model_bytes"]
    return {"gap_over_model": (source["peak_rss_bytes"] - max(r["peak_rss_bytes"] for r in receivers)) / model,
            "source_rss_mb": source["peak_rss_bytes"] / 2**20,
            "receiver_rss_mb": max(r["peak_rss_bytes"] for r in receivers) / 2**20,
            "init_s": max(r["total_s"] for r in ranks), "distribute_s": max(r["distribute_s"] for r in ranks)}


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def table(results: dict, nprocs: list[int], args) -> str:
    lines = ["| ranks per node | code | (source - receiver) peak RSS / model | source peak RSS MiB "
             "| receiver peak RSS MiB | init s | distribute s |", "|---|---|---|---|---|---|---|"]
    for nproc in nprocs:
        for code in ("before", "after"):
            m = results[(code, nproc)]
            lines.append(f"| {nproc} | {code} | {m['gap_over_model']:.3f} | {m['source_rss_mb']:.0f} "
                         f"| {m['receiver_rss_mb']:.0f} | {m['init_s']:.2f} | {m['distribute_s']:.2f} |")
    lines += ["", "| ranks per node | (source - receiver) RSS, after / before | init s, after / before "
                  "| distribute s, after / before |", "|---|---|---|---|"]
    for nproc in nprocs:
        before, after = results[("before", nproc)], results[("after", nproc)]
        lines.append(f"| {nproc} | {after['gap_over_model'] / before['gap_over_model']:.2f} "
                     f"| {after['init_s'] / before['init_s']:.2f} "
                     f"| {after['distribute_s'] / before['distribute_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=600)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--before", required=True, help="git revision to compare with (e.g. main before the change)")
    p.add_argument("--nprocs", default="2,4", help="ranks per node to run")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="source_memory_bench-")
    model = os.path.join(work, "model")
    shape = init_bench.build_checkpoint(args.model_mb, model)
    codes = {"before": extract(args.before, os.path.join(work, "before")), "after": ROOT}
    nprocs = [int(n) for n in args.nprocs.split(",")]
    runs: dict = {}
    for attempt in range(args.repeat):
        for nproc in nprocs:
            for code, root in codes.items():  # alternating, so load on the machine hits both alike
                print(f"{code}, {nproc} ranks per node, run {attempt + 1}...", flush=True)
                results = os.path.join(work, f"{code}-{nproc}-{attempt}")
                runs.setdefault((code, nproc), []).append(
                    launch(root, model, nproc, args.ep, args.bucket_mb, results, args.timeout))
    results = {key: median_of(value) for key, value in runs.items()}
    command = command_line("source_memory_bench.py")
    text = (f"Command: `{command}`\n\nCheckpoint: {shape['checkpoint_mb']:.0f} MiB fp32 Qwen3-MoE (hub layout), "
            f"1 simulated node, ep={args.ep}, init_bucket_mb={args.bucket_mb}, gloo on CPU, {os.cpu_count()} "
            f"CPU cores; before = {args.before}; median of {args.repeat} runs each.\n\n{table(results, nprocs, args)}\n")
    print(text)
    write_results(args.out, "source_memory_bench", text=text, payload={"command": command, "checkpoint": shape,
                   "runs": {f"{code}-{nproc}": value for (code, nproc), value in runs.items()}})


if __name__ == "__main__":
    main()
