"""An FP8 hub release into an FSDP2 + EP model in bf16: this project against its peers, in one run.

    python benchmarks/quant_bench.py --model-mb 600      # the reported run (bf16 size of the model)
    python benchmarks/quant_bench.py --quick             # ~40 MB smoke run

One FP8 checkpoint laid out as DeepSeek-V3 / Qwen3-FP8 ship theirs (float8_e4m3fn projections, float32
``weight_scale_inv`` per 128 x 128 block, per-expert keys, several files), 2 simulated nodes x 2 ranks,
ep=2, gloo on CPU. Every method ends with the same model: the bf16 values ``from_pretrained`` gives.

  ours              NativeFSDPStrategy(memory_efficient_init=True) on the FP8 release: each node's source reads
                    the FP8 rows its node keeps and their scale rows, sends them as stored, each receiver
                    dequantizes its shard
  convert_stream    "convert to bf16 on disk, then stream": from_pretrained(dequantize) + save_pretrained in one
                    process (timed, disk counted), then ours on the bf16 copy
  hf_dequantize     transformers' dequantize=True on every rank (from_pretrained of the release on CPU
                    dequantizes), then EP + fully_shard (NativeFSDPStrategy(memory_efficient_init=False))

Reported per method: disk read per node (the checkpoint bytes a node's processes read), bytes on the wire
per receiving rank, the source's peak RSS (ru_maxrss), init time (slowest rank, from from_pretrained to the
end of wrap_model; convert_stream adds the conversion), extra disk, and a checksum of every rank's shards
(equal across methods: the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
from bench_io import command_line, record_rank, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("ours", "convert_stream", "hf_dequantize")
BF16 = torch.bfloat16


# --------------------------------------------------------------------------- one rank
def run_method(method: str, path: str, ep: int, bucket_mb: float) -> dict:
    import torch.distributed as dist

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.distributed.runtime import peak_rss_bytes

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", memory_efficient_init=method != "hf_dequantize",
                                  init_bucket_mb=bucket_mb, device_type="cpu")
    strategy.setup()
    dist.barrier()
    t0 = time.perf_counter()
    model = strategy.from_pretrained(path, dtype=BF16)
    loaded = time.perf_counter()
    model, _ = strategy.wrap_model(model)
    seconds = time.perf_counter() - t0
    report = strategy.init_report
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    # Every rank's shards summed in float64, then over ranks: equal across methods when the bits are.
    checksum = torch.tensor([sum(p.to_local().double().sum().item() for p in model.parameters())],
                            dtype=torch.float64)
    dist.all_reduce(checksum)
    return {"rank": strategy.rank, "is_source": strategy.topology.is_source, "seconds": seconds,
            "wrap_s": seconds - (loaded - t0), "phases": report.phase_seconds if report else None,
            # hf_dequantize: every rank reads the whole checkpoint (mmap; /proc/self/io does not see it)
            "disk_read": report.bytes_read if report else files,
            "received": report.bytes_received if report else 0,
            "received_decoded": report.bytes_received_decoded if report else 0,
            "peak_rss": peak_rss_bytes(), "checksum": checksum.item()}


def worker_main(args) -> None:
    record_rank(lambda: run_method(args.worker, args.model, args.ep, args.bucket_mb), results_dir=args.results)


# --------------------------------------------------------------------------- driver
def build_release(model_mb: float, path: str, shard_mb: float) -> dict:
    """A Qwen3-MoE FP8 release of about ``model_mb`` MiB in bf16 (128 x 128 blocks, float32 scales)."""
    from twinkle_strategy.testing.releases import save_tiny_quantized_checkpoint

    hidden, inter, experts, vocab = 512, 512, 8, 4096
    if model_mb < 100:
        hidden, inter, vocab = 256, 256, 2048
    per_layer = (experts * 3 * hidden * inter + 4 * hidden * hidden) * 2
    layers = max(1, round((model_mb * 2**20 - 2 * vocab * hidden * 2) / per_layer))
    files = max(2, round(model_mb / 2 / shard_mb))
    save_tiny_quantized_checkpoint("qwen3_moe", path, (128, 128), files=files, hidden_size=hidden,
                                   intermediate_size=inter, num_experts=experts, num_layers=layers, vocab_size=vocab)
    return {"hidden": hidden, "moe_intermediate": inter, "experts": experts, "layers": layers, "vocab": vocab,
            "files": files, "release_mb": _disk(path) / 2**20}


def _disk(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def convert_to_bf16(release: str, out: str) -> float:
    """What users do today (DeepSeek's fp8_cast_bf16.py): file by file, every FP8 weight times its scales, written
    as bf16 under the same keys (transformers 5.23 cannot save_pretrained a model it dequantized). Returns seconds."""
    from safetensors.torch import save_file

    from twinkle_strategy.checkpoint.reading import SafetensorsIndex
    from twinkle_strategy.quantized.formats import QuantFormat, QuantizedIndex

    start = time.perf_counter()
    os.makedirs(out)
    index = QuantizedIndex(SafetensorsIndex.from_directory(release), QuantFormat("fp8", (128, 128)))
    weight_map = {}
    for file in index.stored.files:
        name = os.path.basename(file)
        keys = [k for k, t in index.tensors.items() if index.stored.tensors[t.data_key].file == file]
        save_file({k: index.read(k).to(BF16) for k in keys}, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(release, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    index.close()
    return time.perf_counter() - start


def launch(method: str, model: str, args, results: str) -> dict:
    from twinkle_strategy.train.launcher import run_simulated_nodes

    os.makedirs(results, exist_ok=True)
    worker = "ours" if method == "convert_stream" else method
    script = [os.path.abspath(__file__), "--worker", worker, "--model", model, "--ep", str(args.ep),
              "--bucket-mb", str(args.bucket_mb), "--results", results]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TWINKLE_LOG_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error"}
    outcome = run_simulated_nodes(script, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                                  timeout=args.timeout, env=env, log_dir=results)
    ranks = []
    for r in range(args.nnodes * args.nproc_per_node):
        p = os.path.join(results, f"rank{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                ranks.append(json.load(f))
    return {"method": method, "ok": outcome.ok, "ranks": ranks}


def summarize(run: dict, nproc: int, extra_s: float = 0.0, extra_disk: int = 0, extra_read: int = 0) -> dict:
    ranks = run["ranks"]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or not ranks:
        return {"method": run["method"], "status": f"failed: {errors[:1] or 'no result'}"}
    sources = [r for r in ranks if r["is_source"]]
    receivers = [r for r in ranks if not r["is_source"]]
    per_node = max(r["disk_read"] for r in sources) if run["method"] != "hf_dequantize" else \
        nproc * max(r["disk_read"] for r in ranks)
    return {"method": run["method"], "status": "ok", "disk_read_per_node": per_node + extra_read,
            "wire_per_receiver": max(r["received"] for r in receivers),
            "wire_stands_for": max(r["received_decoded"] for r in receivers),
            "source_peak_rss": max(r["peak_rss"] for r in sources), "init_s": max(r["seconds"] for r in ranks) + extra_s,
            "extra_disk": extra_disk, "checksum": ranks[0]["checksum"], "wrap_s": max(r["wrap_s"] for r in ranks),
            "source_phases": sources[0]["phases"]}


def markdown(rows: list[dict], shape: dict) -> str:
    mib = 2**20
    lines = ["| method | disk read per node (MiB) | on the wire per receiver (MiB) | its bf16 bytes (MiB) | "
             "source peak RSS (MiB) | init s | extra disk (MiB) | checksum |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['status']} |||||||")
            continue
        lines.append(f"| {r['method']} | {r['disk_read_per_node'] / mib:.0f} | {r['wire_per_receiver'] / mib:.1f} | "
                     f"{r['wire_stands_for'] / mib:.1f} | {r['source_peak_rss'] / mib:.0f} | {r['init_s']:.2f} | "
                     f"{r['extra_disk'] / mib:.0f} | {r['checksum']:.6e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=600, help="model size in bf16 (MiB), default 600")
    p.add_argument("--shard-mb", type=float, default=100, help="FP8 file size (MiB)")
    p.add_argument("--quick", action="store_true", help="~40 MiB model (smoke run)")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    work = tempfile.mkdtemp(prefix="quant_bench-")
    release = os.path.join(work, "release")
    shape = build_release(40 if args.quick else args.model_mb, release, args.shard_mb)
    print(f"release: {shape} (work dir {work})", flush=True)
    rows = []
    for method in (args.methods or ",".join(METHODS)).split(","):
        print(f"running {method}...", flush=True)
        if method == "convert_stream":
            converted = os.path.join(work, "bf16")
            convert_s = convert_to_bf16(release, converted)
            run = launch(method, converted, args, os.path.join(work, method))
            rows.append(summarize(run, args.nproc_per_node, extra_s=convert_s, extra_disk=_disk(converted),
                                  extra_read=_disk(release)))
            rows[-1]["convert_s"] = convert_s
            shutil.rmtree(converted)
        else:
            rows.append(summarize(launch(method, release, args, os.path.join(work, method)), args.nproc_per_node))
        print(f"  {rows[-1]}", flush=True)
    command = command_line("quant_bench.py")
    text = (f"Command: `{command}`\n\nRelease: {shape['release_mb']:.0f} MiB FP8 Qwen3-MoE "
            f"({shape['layers']} layers, {shape['experts']} experts, hidden {shape['hidden']}, moe_intermediate "
            f"{shape['moe_intermediate']}, vocab {shape['vocab']}, 128 x 128 blocks, {shape['files']} files), "
            f"loaded in bf16 on {args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep={args.ep}, gloo on "
            f"CPU, {os.cpu_count()} CPU cores. convert_stream's disk read and init s include the conversion "
            f"({next((r.get('convert_s', 0) for r in rows if r['method'] == 'convert_stream'), 0):.2f} s, one "
            f"process reading the whole release).\n\n{markdown(rows, shape)}\n")
    print(text)
    write_results(args.out, "quant_bench", text=text, payload={"command": command, "release": shape, "rows": rows})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
