"""LoRA over a quantized release: the frozen base kept as stored (``quantized_base: keep``) against dequantized.

    python benchmarks/keep_bench.py                 # the reported run
    python benchmarks/keep_bench.py --quick         # smoke run
    python benchmarks/keep_bench.py --at-scale      # only the figures at DeepSeek-V3 / V4-Flash sizes (~1 min)

Two releases, built as they ship (twinkle_strategy.testing.releases): an FP8 Qwen3-MoE (float8_e4m3fn, float32
scales per 128 x 128 block) and a DeepSeek-V4 layout (FP8 dense with ue8m0 scales, FP4 e2m1 experts with a ue8m0
scale per 32). For each, on 2 simulated nodes x 2 ranks, ep=2, gloo on CPU, bf16, LoRA r=8 on attention and
experts, one process per method (``keep``, ``dequantize``):

* frozen bytes per rank: what the rank holds of the quantized weights between steps (InitReport);
* RSS at rest after the init, and the peak RSS during the LoRA steps (the kernel's high-water mark, reset after
  the init via /proc/self/clear_refs), the largest rank;
* tokens/s over the timed steps (after one warm-up step), the global batch.

At scale (``--at-scale``, printed after the runs too): the same accounting at DeepSeek-V3/R1 and
DeepSeek-V4-Flash sizes, without weights. The model is built on the meta device from transformers' config
(its defaults are those releases' sizes), its checkpoint keys come from transformers' rules reversed (as a
save writes them), each quantized weight is declared as its release stores it (data and scale, headers
only) and read through :class:`~twinkle_strategy.quantized.formats.QuantizedIndex`, and each rank's rows are
priced by ``Codec.nbytes`` (what ``WireForm.nbytes`` sums, and so ``InitReport.frozen_stored_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time

import torch
from bench_io import command_line, record_rank, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("dequantize", "keep")
SEQ, PER_RANK = 64, 2


# --------------------------------------------------------------------------- one rank
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run_method(method: str, path: str, ep: int, steps: int) -> dict:
    import gc

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from twinkle_strategy import NativeFSDPStrategy

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", memory_efficient_init=True,
                                  quantized_base=method, device_type="cpu")
    model = strategy.from_pretrained(path, dtype=torch.bfloat16)
    family = model.config.model_type
    attention = ["q_b_proj", "o_b_proj"] if family == "deepseek_v4" else ["q_proj", "o_proj"]
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=attention,
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model, _ = strategy.wrap_model(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(strategy.rank))
    gc.collect()
    rest = _status_kb("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    report = strategy.init_report
    return {"rank": strategy.rank, "frozen_stored": report.frozen_stored_bytes,
            "frozen_values": report.frozen_values_bytes, "frozen_held": report.frozen_held_bytes,
            "rss_rest": rest, "rss_step_peak": _status_kb("VmHWM") * 1024,
            "tokens_per_s": strategy.world_size * PER_RANK * SEQ * steps / sum(times[1:]), "loss": float(loss)}


def worker_main(args) -> None:
    record_rank(lambda: run_method(args.worker, args.model, args.ep, args.steps), results_dir=args.results)


# --------------------------------------------------------------------------- at scale, from the accounting
# The releases: (transformers config class, ranks, FP8 scale dtype, whether routed experts are FP4 e2m1).
AT_SCALE = {"DeepSeek-V3/R1 (671B) on 8 nodes x 8": ("DeepseekV3Config", 64, torch.float32, False),
            "DeepSeek-V4-Flash (284B) on 1 node x 8": ("DeepseekV4Config", 8, torch.float8_e8m0fnu, True)}
FORMULA = """per rank r, over the quantized weights (W: rows x cols; rank r's rows R_r: FSDP2 rows, or whole experts)
  keep        = sum_W Codec(W, R_r).nbytes
              = FP8 blocks:  |R_r| * cols * 1  +  (scale rows R_r needs) * ceil(cols / 128) * scale bytes
                FP4 experts: |R_r| * cols / 2  +  |R_r| * cols / 32 * 1   (ue8m0 per 32)
  dequantize  = sum_W |R_r| * cols * 2   (bf16)"""


def release_headers(model, *, scale_dtype: torch.dtype, fp4_experts: bool) -> dict:
    """The tensors a release of ``model`` stores, by key (shape, dtype): transformers' checkpoint keys for the
    model, the weights the tiny releases quantize (twinkle_strategy.testing.releases' rule) as FP8 with a scale
    per 128 x 128 block, or (``fp4_experts``) routed experts as FP4 with a ue8m0 scale per 32."""
    from twinkle_strategy.checkpoint.layout import CheckpointLayout
    from twinkle_strategy.dtypes import TensorSpec
    from twinkle_strategy.quantized.codec import FP4_GROUP
    from twinkle_strategy.testing.releases import _QUANTIZED_KEY

    tensors = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    out = {}
    for key, (shape, dtype) in CheckpointLayout.for_saving(model, tensors).saved_tensors().items():
        if len(shape) != 2 or not _QUANTIZED_KEY.search(key):
            out[key] = TensorSpec(shape, dtype)
        elif fp4_experts and ".experts." in key:
            out[key] = TensorSpec((shape[0], shape[1] // 2), torch.int8)
            out[key + "_scale_inv"] = TensorSpec((shape[0], shape[1] // FP4_GROUP), torch.float8_e8m0fnu)
        else:
            out[key] = TensorSpec(shape, torch.float8_e4m3fn)
            out[key + "_scale_inv"] = TensorSpec((-(-shape[0] // 128), -(-shape[1] // 128)), scale_dtype)
    return out


def rank_rows(key: str, rows: int, rank: int, ranks: int, experts: int) -> tuple[int, int] | None:
    """Rank ``rank``'s rows of checkpoint tensor ``key`` (None: none of it): FSDP2's rows of a dense weight
    (``ceil(rows / ranks)`` each), or a routed expert's whole tensors on the rank that holds the expert (EP x
    FSDP2 over the experts: ``experts / ranks`` each)."""
    from twinkle_strategy.shards.plan import fsdp_rows

    found = re.search(r"\.experts\.(\d+)\.", key)
    if found:
        return (0, rows) if int(found[1]) // (experts // ranks) == rank else None
    a, b = fsdp_rows(rows, ranks, rank)
    return (a, b) if b > a else None


def at_scale() -> str:
    """Per-rank frozen bytes of the quantized weights, keep against dequantize, at the releases' sizes."""
    import transformers
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.checkpoint.layout import DeclaredTensors
    from twinkle_strategy.quantized.formats import QuantFormat, QuantizedIndex, QuantMethod

    lines = [FORMULA, "", "| release | quantized params | keep per rank (GB) | dequantize per rank (GB) | keep / "
             "dequantize | largest layer decoded per rank (GB) |", "|---|---|---|---|---|---|"]
    for release, (config_class, ranks, scale_dtype, fp4) in AT_SCALE.items():
        config = getattr(transformers, config_class)()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        headers = release_headers(model, scale_dtype=scale_dtype, fp4_experts=fp4)
        index = QuantizedIndex(DeclaredTensors(headers), QuantFormat(QuantMethod.FP8, (128, 128)), model)
        quantized = {key: t for key, t in index.tensors.items() if t.quantized}
        keep, values = [0] * ranks, [0] * ranks
        layer_values: dict[str, int] = {}
        for key, tensor in quantized.items():
            for rank in range(ranks):
                rows = rank_rows(key, tensor.shape[0], rank, ranks, config.n_routed_experts)
                if rows is None:
                    continue
                keep[rank] += index.codec(key, rows).nbytes
                values[rank] += (rows[1] - rows[0]) * tensor.shape[1] * 2
            layer = re.search(r"layers\.(\d+)\.", key)
            if layer:
                layer_values[layer[1]] = layer_values.get(layer[1], 0) + tensor.shape[0] * tensor.shape[1] * 2
        params = sum(t.shape[0] * t.shape[1] for t in quantized.values())
        worst = max(range(ranks), key=lambda r: keep[r])
        lines.append(f"| {release} | {params / 1e9:.1f}B | {keep[worst] / 1e9:.2f} | {values[worst] / 1e9:.2f} | "
                     f"{keep[worst] / values[worst]:.3f} | {max(layer_values.values()) / ranks / 1e9:.2f} |")
    return "\n".join(lines) + ("\n\nThe rank holding the most (keep) is shown. Weights the release keeps in bf16 "
                               "(embeddings, norms, routers, lm_head) are held as they are in both modes, and "
                               "the MTP layer, which transformers does not build, is not counted.")


# --------------------------------------------------------------------------- driver
def build_releases(work: str, quick: bool) -> dict[str, str]:
    from twinkle_strategy.testing.releases import save_tiny_deepseek_v4_release, save_tiny_quantized_checkpoint

    size = dict(hidden_size=256, intermediate_size=256) if quick else dict(hidden_size=512, intermediate_size=512)
    fp8 = save_tiny_quantized_checkpoint("qwen3_moe", os.path.join(work, "fp8"), (128, 128), files=4,
                                         num_experts=8, num_layers=2 if quick else 6, vocab_size=2048, **size)
    fp4 = save_tiny_deepseek_v4_release(os.path.join(work, "fp4"), (128, 128), files=4, num_experts=16,
                                        vocab_size=2048, **size)
    return {"FP8 blocks (Qwen3-MoE)": fp8, "FP4 experts (DeepSeek-V4 layout)": fp4}


def launch(method: str, model: str, args, results: str) -> list[dict]:
    from twinkle_strategy.train.launcher import run_simulated_nodes

    os.makedirs(results, exist_ok=True)
    script = [os.path.abspath(__file__), "--worker", method, "--model", model, "--ep", str(args.ep), "--steps",
              str(args.steps), "--results", results]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TWINKLE_LOG_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error"}
    run_simulated_nodes(script, nnodes=2, nproc_per_node=2, timeout=args.timeout, env=env, log_dir=results)
    ranks = []
    for r in range(4):
        p = os.path.join(results, f"rank{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                ranks.append(json.load(f))
    return ranks


def summarize(release: str, path: str, method: str, ranks: list[dict]) -> dict:
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or len(ranks) != 4:
        return {"release": release, "method": method, "status": f"failed: {errors[:1] or 'missing ranks'}"}
    quantized_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return {"release": release, "method": method, "status": "ok",
            "frozen_held": max(r["frozen_held"] for r in ranks),
            "frozen_bf16": max(sum(r["frozen_values"].values()) for r in ranks),
            "frozen_stored_all_ranks": sum(sum(r["frozen_stored"].values()) for r in ranks),
            "rss_rest": max(r["rss_rest"] for r in ranks), "rss_step_peak": max(r["rss_step_peak"] for r in ranks),
            "tokens_per_s": min(r["tokens_per_s"] for r in ranks), "release_bytes": quantized_disk,
            "loss": ranks[0]["loss"]}


def markdown(rows: list[dict]) -> str:
    mib = 2**20
    lines = ["| release | method | frozen bytes per rank (MiB) | / bf16 | RSS at rest (MiB) | peak RSS in a step (MiB) "
             "| tokens/s | last loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['release']} | {r['method']} | {r['status']} ||||||")
            continue
        lines.append(f"| {r['release']} | {r['method']} | {r['frozen_held'] / mib:.1f} | "
                     f"{r['frozen_held'] / r['frozen_bf16']:.3f} | {r['rss_rest'] / mib:.0f} | "
                     f"{r['rss_step_peak'] / mib:.0f} | {r['tokens_per_s']:.0f} | {r['loss']:.5f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    out = []
    for release in dict.fromkeys(r["release"] for r in rows):
        by = {r["method"]: r for r in rows if r["release"] == release and r["status"] == "ok"}
        if len(by) == 2:
            keep, deq = by["keep"], by["dequantize"]
            out.append(f"- {release}: keep / dequantize: frozen bytes {keep['frozen_held'] / deq['frozen_held']:.3f}, "
                       f"RSS at rest {keep['rss_rest'] / deq['rss_rest']:.3f}, peak RSS in a step "
                       f"{keep['rss_step_peak'] / deq['rss_step_peak']:.3f}, tokens/s "
                       f"{keep['tokens_per_s'] / deq['tokens_per_s']:.3f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--at-scale", action="store_true", help="only the figures at DeepSeek-V3 and V4-Flash sizes")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    if args.at_scale:
        text = f"Command: `python benchmarks/keep_bench.py --at-scale`\n\n{at_scale()}\n"
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "keep_bench_at_scale.md"), "w") as f:
            f.write(text)
        return None
    work = tempfile.mkdtemp(prefix="keep_bench-")
    rows = []
    for release, path in build_releases(work, args.quick).items():
        for method in METHODS:
            print(f"running {release} {method}...", flush=True)
            rows.append(summarize(release, path, method, launch(method, path, args, os.path.join(work, release,
                                                                                               method))))
            print(f"  {rows[-1]}", flush=True)
    command = command_line("keep_bench.py")
    text = (f"Command: `{command}`\n\n2 simulated nodes x 2 ranks, ep=2, bf16, LoRA r=8 (attention and "
            f"experts), {PER_RANK} x {SEQ} tokens per rank, {args.steps} timed steps, gloo on CPU, "
            f"{os.cpu_count()} CPU cores.\n\n{markdown(rows)}\n\n{ratios(rows)}\n\nAt scale (the same "
            f"accounting; `--at-scale` prints only this):\n\n{at_scale()}\n")
    print(text)
    write_results(args.out, "keep_bench", text=text, payload={"command": command, "rows": rows})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
