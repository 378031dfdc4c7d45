"""Getting a pretrained MoE checkpoint into an FSDP2 + EP model: this project against its peers, in one run.

    python benchmarks/init_bench.py                 # ~200 MB model, 2 nodes x 2 ranks, ep=2
    python benchmarks/init_bench.py --quick         # ~20 MB smoke run
    python benchmarks/init_bench.py --scaling       # also 1, 2, 3 simulated nodes for ours and the node-local baseline

Each method runs in fresh processes (one torchrun agent per simulated node on
127.0.0.1, gloo on CPU), on the same synthetic Qwen3-MoE safetensors checkpoint:

  ours_mem      NativeFSDPStrategy(memory_efficient_init=True): node-local sources, bucketed shards
  ours_plain    NativeFSDPStrategy(memory_efficient_init=False): every rank reads the checkpoint
  accelerate    accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict: global rank 0 broadcasts every tensor
  dcp           torch DCP set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)
  node_bcast    per-parameter node-local baseline: each node's local rank 0 broadcasts every full tensor
                inside its node, every rank slices its shard (the node-local design peers ship)

For accelerate and DCP, rank 0's state dict is that of its own EP-sliced model
(what those libraries see after EP is applied), so the result shows what
happens to the other EP ranks' experts. Bytes and collective calls are counted
by wrapping the torch.distributed functions in each worker; "received" counts
tensor payloads arriving at a rank (broadcast from another rank, scatter,
recv), not control messages.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("ours_mem", "ours_plain", "accelerate", "dcp", "node_bcast")


# --------------------------------------------------------------------------- counting
class Counter:
    def __init__(self):
        self.calls = 0
        self.bytes_received = 0

    def install(self):
        import torch.distributed as dist

        rank = dist.get_rank()

        def nbytes(t):
            return t.numel() * t.element_size()

        def wrap(name, received, calls=lambda *a, **k: 1):
            original = getattr(dist, name)

            @functools.wraps(original)
            def counted(*args, **kwargs):
                self.calls += calls(*args, **kwargs)
                self.bytes_received += received(*args, **kwargs)
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        def broadcast(tensor, src=None, *a, **k):
            return 0 if src == rank else nbytes(tensor)

        def scatter(tensor, scatter_list=None, src=None, *a, **k):
            return 0 if src == rank else nbytes(tensor)

        def recv(tensor, *a, **k):
            return nbytes(tensor)

        wrap("broadcast", broadcast)
        wrap("scatter", scatter)
        wrap("recv", recv)
        # P2POp only accepts torch's own isend/irecv, so p2p transfers are counted where they are
        # batched: one call per isend/irecv in the batch.
        wrap("batch_isend_irecv", lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv),
             calls=lambda ops: len(ops))
        for name in ("send", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_reduce", "all_to_all_single", "broadcast_object_list", "all_gather_object",
                     "gather_object"):
            wrap(name, lambda *a, **k: 0)


# --------------------------------------------------------------------------- workers
def _meta_wrapped(strategy, config, dtype):
    """A meta model, EP-cut and fully_shard-ed exactly like ours, then materialised (uninitialised)."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.fsdp import apply_fsdp, mixed_precision_policy
    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    strategy.ep_plan = apply_expert_parallel(model, strategy.dims, strategy.rank, strategy.meshes.ep_group)
    apply_fsdp(model, strategy.meshes, [b.experts for b in find_moe_blocks(model)], mixed_precision_policy("no"))
    model.to_empty(device=strategy.device)
    return model


def _rank0_ep_state_dict(strategy, path):
    """What a peer's rank 0 holds after EP: its own model, experts cut to *its* slice."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_expert_parallel(model, strategy.dims, 0, strategy.meshes.ep_group)
    return {k: v for k, v in model.state_dict().items()}


def run_method(method: str, path: str, ep: int, bucket_mb: float) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig

    from twinkle_strategy import NativeFSDPStrategy

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", memory_efficient_init=(method == "ours_mem"),
                                  init_bucket_mb=bucket_mb, device_type="cpu")
    strategy.setup()
    counter = Counter()
    counter.install()
    dist.barrier()
    t0 = time.perf_counter()
    distribute_s = None
    if method in ("ours_mem", "ours_plain"):
        model = strategy.from_pretrained(path)
        t1 = time.perf_counter()
        model, _ = strategy.wrap_model(model)
        distribute_s = strategy.init_report.seconds if strategy.init_report else time.perf_counter() - t1
    else:
        config = AutoConfig.from_pretrained(path)
        if method == "node_bcast":
            from twinkle_strategy.parallel import build_node_groups

            node_group = build_node_groups(strategy.topology, strategy.device)
            source = strategy.topology.source_rank
            full = None
            if strategy.topology.is_source:
                from transformers import AutoModelForCausalLM

                loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                full = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
            model = _meta_wrapped(strategy, config, torch.float32)
            from twinkle_strategy.init.plan import needs_of, source_region

            t1 = time.perf_counter()
            for need, local in needs_of(model, strategy.ep_plan):
                # The peer algorithm: the whole pre-EP tensor goes to every rank of the node...
                shape = full[need.name].shape if full is not None else None
                shape = [shape]
                dist.broadcast_object_list(shape, src=source, group=node_group)
                tensor = full[need.name].detach() if full is not None else torch.empty(shape[0], dtype=need.dtype)
                dist.broadcast(tensor, src=source, group=node_group)
                # ...and each rank cuts out what it keeps.
                with torch.no_grad():
                    local.copy_(source_region(need, {need.name: tensor}, strategy.ep_plan).reshape(local.shape))
            distribute_s = time.perf_counter() - t1
        else:
            full_sd = _rank0_ep_state_dict(strategy, path) if strategy.rank == 0 else {}
            model = _meta_wrapped(strategy, config, torch.float32)
            t1 = time.perf_counter()
            if method == "accelerate":
                import types

                from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

                # The function reads one thing from its Accelerator: whether this is the main process.
                fsdp2_load_full_state_dict(types.SimpleNamespace(is_main_process=strategy.rank == 0), model, full_sd)
            else:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
            distribute_s = time.perf_counter() - t1
            del full_sd
    dist.barrier()
    total_s = time.perf_counter() - t0
    calls, received = counter.calls, counter.bytes_received
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    from twinkle_strategy.platform import peak_rss_bytes

    peak = peak_rss_bytes()
    # Correctness: gather (ours: FSDP + EP join) and compare with the checkpoint on rank 0.
    state = strategy.full_state_dict(model, rank0_only=True)
    wrong = None
    if strategy.rank == 0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        wrong = sorted(k for k in ref if k not in state or not torch.equal(state[k], ref[k]))
    # Weights a rank reads from disk: the whole checkpoint where it loads one, nothing elsewhere.
    loads = method == "ours_plain" or (method in ("ours_mem", "node_bcast") and strategy.topology.is_source) \
        or (method in ("accelerate", "dcp") and strategy.rank == 0)
    disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    phases = strategy.init_report.phase_seconds if strategy.init_report else None
    return {"method": method, "rank": strategy.rank, "is_source": strategy.topology.is_source,
            "disk_read_bytes": disk if loads else 0, "phase_seconds": phases,
            "total_s": total_s, "distribute_s": distribute_s, "bytes_received": received, "shard_bytes": shard_bytes,
            "collective_calls": calls, "peak_rss_bytes": peak, "wrong_tensors": wrong}


def worker_main(args) -> None:
    try:
        result = run_method(args.worker, args.model, args.ep, args.bucket_mb)
    except Exception as exc:  # noqa: BLE001 - a peer that crashes is a result too
        import traceback

        result = {"method": args.worker, "rank": int(os.environ["RANK"]), "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    with open(os.path.join(args.results, f"{args.worker}-rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0 if "error" not in result else 1)


# --------------------------------------------------------------------------- driver
def build_checkpoint(model_mb: float, path: str) -> dict:
    from twinkle_strategy.tiny_models import save_tiny_checkpoint

    hidden, inter, experts, vocab = 512, 512, 8, 4096
    per_layer = (experts * 3 * hidden * inter + 4 * hidden * hidden) * 4
    layers = max(1, round((model_mb * 2**20 - 2 * vocab * hidden * 4) / per_layer))
    if model_mb < 50:
        hidden, inter, vocab, layers = 256, 256, 2048, max(1, round(model_mb / 7))
    save_tiny_checkpoint("qwen3_moe", path, hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                         num_layers=layers, vocab_size=vocab)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return {"hidden": hidden, "moe_intermediate": inter, "experts": experts, "layers": layers, "vocab": vocab,
            "checkpoint_mb": size / 2**20}


def run_launch(method, model, nnodes, nproc, ep, bucket_mb, results_dir, timeout):
    from twinkle_strategy.launcher import run_simulated_nodes

    os.makedirs(results_dir, exist_ok=True)
    script = [os.path.abspath(__file__), "--worker", method, "--model", model, "--ep", str(ep),
              "--bucket-mb", str(bucket_mb), "--results", results_dir]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TWINKLE_LOG_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error"}
    start = time.perf_counter()
    result = run_simulated_nodes(script, nnodes=nnodes, nproc_per_node=nproc, timeout=timeout, env=env,
                                 log_dir=results_dir)
    ranks = []
    for r in range(nnodes * nproc):
        p = os.path.join(results_dir, f"{method}-rank{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                ranks.append(json.load(f))
    return {"method": method, "nnodes": nnodes, "ok": result.ok, "timed_out": result.timed_out,
            "wall_s": time.perf_counter() - start, "ranks": ranks}


def summarize(run: dict) -> dict:
    ranks = [r for r in run["ranks"] if "error" not in r]
    errors = sorted({r["error"].split("\n")[0][:160] for r in run["ranks"] if "error" in r})
    if run["timed_out"]:
        errors.append("timed out")
    if not ranks or errors:
        return {"method": run["method"], "nnodes": run["nnodes"], "status": "; ".join(errors) or "no result"}
    non_source = [r for r in ranks if not r["is_source"]] or ranks
    source = [r for r in ranks if r["is_source"]] or ranks
    ratio = [r["bytes_received"] / r["shard_bytes"] for r in non_source]
    incoming = [(r["bytes_received"] + r["disk_read_bytes"]) / r["shard_bytes"] for r in non_source]
    wrong = next((r["wrong_tensors"] for r in ranks if r["rank"] == 0), None)
    return {
        "method": run["method"], "nnodes": run["nnodes"],
        "status": "correct" if wrong == [] else f"WRONG: {len(wrong)} tensors differ (e.g. {wrong[0]})",
        "init_s": max(r["total_s"] for r in ranks),
        "distribute_s": max(r["distribute_s"] for r in ranks),
        "recv_mb_min": min(r["bytes_received"] for r in non_source) / 2**20,
        "recv_mb_max": max(r["bytes_received"] for r in non_source) / 2**20,
        "recv_over_shard_min": min(ratio), "recv_over_shard_max": max(ratio),
        "in_over_shard_max": max(incoming),
        "calls_max": max(r["collective_calls"] for r in ranks),
        "rss_source_mb": max(r["peak_rss_bytes"] for r in source) / 2**20,
        "rss_nonsource_mb": max(r["peak_rss_bytes"] for r in non_source) / 2**20,
    }


def markdown(rows: list[dict]) -> str:
    head = ("| method | nodes | result | init s | distribute s | network recv / shard (non-source, min-max) "
            "| network + disk in / shard (non-source, max) | collective calls (max/rank) | peak RSS source MiB "
            "| peak RSS non-source MiB |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "init_s" not in r:
            lines.append(f"| {r['method']} | {r['nnodes']} | {r['status']} |  |  |  |  |  |  |  |")
            continue
        lines.append(f"| {r['method']} | {r['nnodes']} | {r['status']} | {r['init_s']:.2f} | {r['distribute_s']:.2f} "
                     f"| {r['recv_over_shard_min']:.2f}-{r['recv_over_shard_max']:.2f} | {r['in_over_shard_max']:.2f} "
                     f"| {r['calls_max']} | {r['rss_source_mb']:.0f} | {r['rss_nonsource_mb']:.0f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    ours = next(r for r in rows if r["method"] == "ours_mem" and "init_s" in r)
    # Peers: what users would pick instead (not our own every-rank-loads baseline).
    peers = [r for r in rows if r["method"] in ("accelerate", "dcp", "node_bcast") and "init_s" in r
             and r["nnodes"] == ours["nnodes"]]
    out = ["| column | ours_mem | best peer (any result) | ours / best peer |", "|---|---|---|---|"]
    for key, label in (("init_s", "init s"), ("distribute_s", "distribute s"),
                       ("in_over_shard_max", "bytes in (network + disk) / shard, non-source max"),
                       ("calls_max", "collective calls"), ("rss_source_mb", "peak RSS source MiB"),
                       ("rss_nonsource_mb", "peak RSS non-source MiB")):
        best = min(peers, key=lambda r: r[key])
        value = best[key] if best[key] else 1e-9
        out.append(f"| {label} | {ours[key]:.3g} | {best[key]:.3g} ({best['method']}) | {ours[key] / value:.2f} |")
    return "\n".join(out)


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "init_s" in r and r["nnodes"] == rows[0]["nnodes"]]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("init_s", "in_over_shard_max", "rss_nonsource_mb"),
                              ("whole init (s)", "bytes in (network + disk) / shard, non-source",
                               "peak RSS non-source (MiB)")):
        bars = ax.bar(names, [r[key] for r in rows],
                      color=["tab:green" if n == "ours_mem" else "tab:gray" for n in names])
        for bar, r in zip(bars, rows):
            if not r["status"].startswith("correct"):
                bar.set_hatch("//")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("memory_efficient_init vs peers (hatched: wrong weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=200)
    p.add_argument("--quick", action="store_true", help="~20 MB model")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--scaling", action="store_true", help="also 1, 2, 3 nodes for ours_mem and node_bcast")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--render", metavar="JSON", help="re-render the table and chart from an earlier results JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    os.makedirs(args.out, exist_ok=True)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        return report(saved["rows"], saved["runs"], saved["checkpoint"], saved["command"], args)
    model_mb = 20 if args.quick else args.model_mb
    work = tempfile.mkdtemp(prefix="init_bench-")
    ckpt = os.path.join(work, "model")
    shape = build_checkpoint(model_mb, ckpt)
    print(f"checkpoint: {shape}", flush=True)
    runs = []
    for method in args.methods.split(","):
        print(f"running {method} ({args.nnodes} nodes x {args.nproc_per_node})...", flush=True)
        runs.append(run_launch(method, ckpt, args.nnodes, args.nproc_per_node, args.ep, args.bucket_mb,
                               os.path.join(work, f"{method}-{args.nnodes}"), args.timeout))
    rows = [summarize(r) for r in runs]
    if args.scaling:
        for nnodes in (1, 2, 3):
            for method in ("ours_mem", "node_bcast"):
                if nnodes == args.nnodes and method in args.methods:
                    continue
                print(f"scaling: {method} with {nnodes} nodes...", flush=True)
                run = run_launch(method, ckpt, nnodes, args.nproc_per_node, args.ep, args.bucket_mb,
                                 os.path.join(work, f"{method}-{nnodes}"), args.timeout)
                rows.append(summarize(run))
    command = "python benchmarks/init_bench.py " + " ".join(sys.argv[1:])
    report(rows, runs, shape, command, args)


def report(rows, runs, shape, command, args) -> None:
    table = markdown(rows)
    text = (f"Command: `{command.strip()}`\n\nCheckpoint: {shape['checkpoint_mb']:.0f} MiB fp32 Qwen3-MoE "
            f"({shape['layers']} layers, {shape['experts']} experts, hidden {shape['hidden']}); "
            f"{args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep={args.ep}, gloo on CPU.\n\n"
            f"{table}\n\nRatios, ours_mem / best peer on each column (lower is better):\n\n{ratios(rows)}\n")
    print(text)
    with open(os.path.join(args.out, "init_bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "init_bench.json"), "w") as f:
        json.dump({"command": command, "checkpoint": shape, "rows": rows, "runs": runs}, f, indent=1, default=str)
    chart(rows, os.path.join(args.out, "init_bench.png"))
    print(f"wrote {args.out}/init_bench.md, .json, .png")


if __name__ == "__main__":
    main()
