"""Getting a pretrained MoE checkpoint into an FSDP2 + EP model: this project against its peers, in one run.

    python benchmarks/init_bench.py --model-mb 1200 --shard-mb 200 --scaling   # the reported run (1.2 GB, 1/2/3 nodes)
    python benchmarks/init_bench.py --scaling       # 200 MB model, 2 nodes x 2 ranks, ep=2, + 1/2/3-node scaling
    python benchmarks/init_bench.py --quick         # ~20 MB smoke run, three methods

Each method runs in fresh processes (one torchrun agent per simulated node on
127.0.0.1, gloo on CPU), on the same synthetic Qwen3-MoE safetensors checkpoint,
with the same EP cut and the same fully_shard calls as ours:

  ours_stream        NativeFSDPStrategy(memory_efficient_init=True): every rank builds the model without weights;
                     each node's source reads from the files only its node's rows and sends them in buckets
  ours_mem           the same with stream_checkpoint=False: each node's source loads the whole model in host
                     memory first, then sends each local rank its shards from it (the in-memory path)
  ours_plain         NativeFSDPStrategy(memory_efficient_init=False): every rank reads the checkpoint
  accelerate         accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict: global rank 0 broadcasts every
                     tensor to the world, each rank distribute_tensor()s it (a scatter per tensor)
  dcp                torch DCP set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)
  node_bcast         per-parameter node-local baseline: each node's local rank 0 broadcasts every FULL
                     tensor inside its node (one collective per tensor), every rank slices its shard
  dcp_hf             torch DCP dcp.load with HuggingFaceStorageReader: every rank reads its own slices from the
                     safetensors files. It has no conversion rules, so it reads a copy of the checkpoint written
                     in the model's own layout (fused expert tensors); the hub layout has no key it could match
  accelerate_fullsd  accelerate with rank 0 passing the whole (pre-EP) checkpoint state dict
  dcp_fullsd         DCP with rank 0 passing the whole (pre-EP) checkpoint state dict

For accelerate and dcp, rank 0's state dict is that of its own model after EP
(experts cut to rank 0's slice), which is what those loaders see in an EP job;
the *_fullsd variants hand them the unsliced checkpoint instead. Every method
ends with the same check: FSDP shards and EP slices gathered on rank 0 and
compared bit for bit with a single-process from_pretrained, and every rank's
buffers (RoPE inv_freq...) compared too.

Bytes and collective calls are counted by wrapping the torch.distributed
functions in each worker (every module-level reference, so DTensor's internal
scatter is seen; only the outermost call counts). "Received" is tensor payload
arriving at a rank (broadcast from another rank, scatter, recv, all_gather...);
pickled control objects count as calls with 0 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from bench_io import command_line, record_rank, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("ours_stream", "ours_mem", "ours_plain", "accelerate", "dcp", "node_bcast", "dcp_hf", "accelerate_fullsd",
           "dcp_fullsd")
OURS = ("ours_stream", "ours_mem", "ours_plain")
QUICK_METHODS = ("ours_stream", "ours_mem", "node_bcast")


# --------------------------------------------------------------------------- counting
# Collectives a method may call while loading, with how many tensor bytes arrive at this rank.
_COUNTED = ("broadcast", "scatter", "recv", "send", "batch_isend_irecv", "_broadcast_coalesced", "all_gather",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
            "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "gather", "barrier")


class Counter:
    """Counts calls and received tensor bytes of torch.distributed functions in this process.

    The wrapper replaces every module-level reference to the original function,
    not only ``torch.distributed.<name>``: DTensor's ``distribute_tensor``
    reaches ``scatter``/``broadcast`` through ``from ... import`` names, which a
    plain ``setattr(dist, ...)`` would miss. Only the outermost call is counted
    (``broadcast_object_list`` calls ``broadcast`` inside). Object collectives
    (pickled control messages) count as calls with 0 bytes.
    """

    def __init__(self):
        self.calls = 0
        self.bytes_received = 0
        self.by_name: dict[str, int] = {}
        self._depth = 0
        self._installed: list[tuple[object, str, object]] = []

    def uncounted_barrier(self):
        """A measurement aid, not part of any method: every rank enters the timed phase together."""
        import torch.distributed as dist

        self._depth += 1
        try:
            dist.barrier()
        finally:
            self._depth -= 1

    def snapshot(self) -> dict:
        return {"calls": self.calls, "bytes_received": self.bytes_received, "by_name": dict(self.by_name)}

    def install(self):
        import torch.distributed as dist

        rank = dist.get_rank()

        def nbytes(t):
            return t.numel() * t.element_size()

        def source(args, kwargs, pos):
            src = kwargs.get("src", args[pos] if len(args) > pos else None)
            if src is None and kwargs.get("group_src") is not None:
                src = dist.get_global_rank(kwargs.get("group") or dist.group.WORLD, kwargs["group_src"])
            return src

        def broadcast(tensor, *a, **k):
            return 0 if source((tensor, *a), k, 1) == rank else nbytes(tensor)

        def scatter(tensor, *a, **k):
            return 0 if source((tensor, *a), k, 2) == rank else nbytes(tensor)

        def broadcast_coalesced(pg, tensors, buffer_size, src=0):
            return 0 if dist.get_global_rank(pg, src) == rank else sum(nbytes(t) for t in tensors)

        def all_gather(tensor_list, tensor, *a, **k):
            return sum(nbytes(t) for t in tensor_list) - nbytes(tensor)

        def all_gather_into_tensor(output, input, *a, **k):
            return nbytes(output) - nbytes(input)

        received = {
            "broadcast": broadcast, "scatter": scatter, "recv": lambda t, *a, **k: nbytes(t),
            "_broadcast_coalesced": broadcast_coalesced, "all_gather": all_gather,
            "all_gather_into_tensor": all_gather_into_tensor,
            "reduce_scatter_tensor": lambda out, inp, *a, **k: nbytes(inp) - nbytes(out),
            "all_reduce": lambda t, *a, **k: nbytes(t),
            "all_to_all_single": lambda out, inp, *a, **k: nbytes(out),
            # P2POp only accepts torch's own isend/irecv, so p2p transfers are counted where they
            # are batched: one call per isend/irecv in the batch.
            "batch_isend_irecv": lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv),
        }
        calls = {"batch_isend_irecv": lambda ops, *a, **k: len(ops)}
        modules = [m for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in
                   ("torch", "accelerate", "transformers", "twinkle_strategy", "__main__")]
        for name in _COUNTED:
            original = getattr(dist, name)
            count_bytes = received.get(name, lambda *a, **k: 0)
            count_calls = calls.get(name, lambda *a, **k: 1)

            def counted(*args, _original=original, _bytes=count_bytes, _calls=count_calls, _name=name, **kwargs):
                if self._depth == 0:
                    n = _calls(*args, **kwargs)
                    self.calls += n
                    self.by_name[_name] = self.by_name.get(_name, 0) + n
                    self.bytes_received += _bytes(*args, **kwargs)
                self._depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self._depth -= 1

            for module in modules:
                if vars(module).get(name) is original:
                    setattr(module, name, counted)
                    self._installed.append((module, name, original))

    def uninstall(self):
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed.clear()


# --------------------------------------------------------------------------- workers
def _peer_model(config, dtype):
    """A peer's starting model: parameters on meta, buffers (RoPE ``inv_freq``...) computed on CPU.

    That is what accelerate's non-main ranks hold (``init_empty_weights(include_buffers=False)``);
    the buffers are saved here and re-registered after loading, as ``fsdp2_prepare_model`` does.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    return model, buffers


def _restore_buffers(model, buffers):
    with torch.no_grad():
        for name, saved in buffers.items():
            module_name, _, key = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._buffers[key] = saved.to(module._buffers[key].device)


def _shard(strategy, model, materialize: bool):
    """EP-cut and fully_shard on meta exactly like ours, then (optionally) allocate this rank's shards."""
    from twinkle_strategy.fsdp import apply_fsdp, mixed_precision_policy
    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel

    strategy.ep_plan = apply_expert_parallel(model, strategy.dims, strategy.rank, ep_group=strategy.meshes.ep_group)
    apply_fsdp(model, strategy.meshes, [b.experts for b in find_moe_blocks(model)], mixed_precision_policy("no"))
    if materialize:
        model.to_empty(device=strategy.device)
    return model


def _rank0_state_dict(strategy, path, ep_sliced: bool):
    """What a peer's rank 0 holds: its loaded model, experts cut to *its* EP slice when ``ep_sliced``."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if ep_sliced:
        apply_expert_parallel(model, strategy.dims, 0, ep_group=strategy.meshes.ep_group)
    return dict(model.state_dict())


def _node_bcast(strategy, path, config, counter):
    """Twinkle-style node-local baseline: per tensor, the node source broadcasts the FULL tensor in its node."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.shards.plan import needs_of, region_of

    topo = strategy.topology
    full = None
    if topo.is_source:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        full = {**{n: p.detach() for n, p in loaded.named_parameters()},
                **{n: b.detach() for n, b in loaded.named_buffers()}}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Pre-EP shapes come from the config (the meta model before EP), so no metadata has to travel.
    shapes = {n: t.shape for n, t in [*model.named_parameters(), *model.named_buffers()]}
    _shard(strategy, model, materialize=True)
    counter.uncounted_barrier()
    t1 = time.perf_counter()
    for need, local in needs_of(model, strategy.ep_plan):
        # The whole pre-EP tensor goes to every rank of the node...
        tensor = full[need.name] if full is not None else torch.empty(shapes[need.name], dtype=need.dtype)
        dist.broadcast(tensor, src=topo.source_rank, group=strategy._bench_node_group)
        # ...and each rank cuts out what it keeps.
        with torch.no_grad():
            local.copy_(region_of(tensor, need, strategy.ep_plan).reshape(local.shape))
    return model, time.perf_counter() - t1, time.time()


class SliceReadCounter:
    """Bytes read through safetensors' ``safe_open(...).get_slice(...)[...]`` (DCP's HuggingFaceStorageReader)."""

    def __init__(self):
        import safetensors

        self.bytes = 0
        self._module, self._original = safetensors, safetensors.safe_open
        counter = self

        class CountingSafeOpen:
            def __init__(self, *args, **kwargs):
                self._file = counter._original(*args, **kwargs)

            def __enter__(self):
                self._file.__enter__()
                return self

            def __exit__(self, *exc):
                return self._file.__exit__(*exc)

            def get_slice(self, name):
                part = self._file.get_slice(name)

                class Slice:
                    def __getitem__(self, index):
                        tensor = part[index]
                        counter.bytes += tensor.numel() * tensor.element_size()
                        return tensor

                    def __getattr__(self, attr):
                        return getattr(part, attr)

                return Slice()

            def __getattr__(self, attr):
                return getattr(self._file, attr)

        safetensors.safe_open = CountingSafeOpen


def _dcp_hf_load(strategy, model, path):
    """torch DCP: every rank reads its own DTensor slices from the safetensors files of ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = model.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path))
    model.load_state_dict(state)


def _chars_read() -> int:
    """Bytes this process read with read()/pread() so far (/proc/self/io rchar; mmap page faults not included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def run_method(method: str, path: str, ep: int, bucket_mb: float, timeout_s: float) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.distributed.runtime import peak_rss_bytes

    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no",
                                  memory_efficient_init=method in ("ours_stream", "ours_mem"),
                                  stream_checkpoint=method == "ours_stream",
                                  init_bucket_mb=bucket_mb, device_type="cpu", timeout_s=timeout_s)
    strategy.setup()
    if method == "node_bcast":  # the baseline's node groups, created outside the timed region like ours
        import datetime

        strategy._bench_node_group, _ = dist.new_subgroups_by_enumeration(
            [list(r) for r in strategy.topology.node_ranks], timeout=datetime.timedelta(seconds=timeout_s))
    counter = Counter()
    counter.install()
    slices = SliceReadCounter() if method == "dcp_hf" else None
    dist.barrier()
    counter.calls, counter.bytes_received, counter.by_name = 0, 0, {}  # the barrier above is not a load call
    chars_before = _chars_read()
    t0 = time.perf_counter()
    report = None
    if method in OURS:
        model = strategy.from_pretrained(path)
        t1 = time.perf_counter()
        model, _ = strategy.wrap_model(model)
        report = strategy.init_report
        # ours_plain: wrap_model is EP + fully_shard of a model every rank loaded; nothing is distributed.
        distribute_s = report.seconds if report else time.perf_counter() - t1
        distribute_end = time.time()
    else:
        config = AutoConfig.from_pretrained(path)
        if method == "node_bcast":
            model, distribute_s, distribute_end = _node_bcast(strategy, path, config, counter)
        elif method == "dcp_hf":
            model, buffers = _peer_model(config, torch.float32)
            _shard(strategy, model, materialize=True)
            counter.uncounted_barrier()
            t1 = time.perf_counter()
            _dcp_hf_load(strategy, model, path + MODEL_LAYOUT_SUFFIX)
            distribute_s, distribute_end = time.perf_counter() - t1, time.time()
            _restore_buffers(model, buffers)
        else:
            full_sd = _rank0_state_dict(strategy, path, ep_sliced=not method.endswith("_fullsd")) \
                if strategy.rank == 0 else {}
            model, buffers = _peer_model(config, torch.float32)
            # accelerate expects the sharded model on meta (it assigns new shards); DCP fills allocated shards.
            _shard(strategy, model, materialize=method.startswith("dcp"))
            counter.uncounted_barrier()
            t1 = time.perf_counter()
            if method.startswith("accelerate"):
                import types

                from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

                # The function reads one thing from its Accelerator: whether this is the main process.
                fsdp2_load_full_state_dict(types.SimpleNamespace(is_main_process=strategy.rank == 0), model, full_sd)
            else:
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    set_model_state_dict,
                )

                set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
            distribute_s = time.perf_counter() - t1
            distribute_end = time.time()
            _restore_buffers(model, buffers)
            del full_sd
    counts = counter.snapshot()
    counter.uninstall()
    chars_read = _chars_read() - chars_before
    peak = peak_rss_bytes()
    dist.barrier()
    total_s = time.perf_counter() - t0
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    # Correctness: gather (FSDP + EP join) and compare with a single-process from_pretrained on rank 0;
    # buffers (every rank keeps full copies) are gathered from every rank and compared too.
    state = strategy.full_state_dict(model, rank0_only=True)
    my_buffers = {n: b.detach().cpu() for n, b in model.named_buffers()}
    all_buffers = [None] * dist.get_world_size() if strategy.rank == 0 else None
    dist.gather_object(my_buffers, all_buffers, dst=0)
    wrong, wrong_buffers = None, None
    if strategy.rank == 0:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref = ref_model.state_dict()
        wrong = sorted(k for k in ref if k not in state or not torch.equal(state[k], ref[k]))
        wrong_buffers = sorted({f"{n}@rank{r}" for r, bufs in enumerate(all_buffers)
                                for n, b in ref_model.named_buffers()
                                if n not in bufs or not torch.equal(bufs[n], b)})
    # Weight bytes a rank reads from disk: ours_stream counts them (InitReport.bytes_read, cross-checked with
    # /proc/self/io); dcp_hf's slices are counted at safetensors; the others read the whole checkpoint where
    # they load one (from_pretrained memory-maps it, which /proc/self/io does not see) and nothing elsewhere.
    disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    if method == "ours_stream":
        disk_read = report.bytes_read
    elif method == "dcp_hf":
        disk_read = slices.bytes
    else:
        loads = method == "ours_plain" or (method in ("ours_mem", "node_bcast") and strategy.topology.is_source) \
            or (method not in OURS + ("node_bcast",) and strategy.rank == 0)
        disk_read = disk if loads else 0
    init_report = None
    if report is not None:
        init_report = {k: getattr(report, k) for k in ("seconds", "bytes_sent", "bytes_received", "shard_bytes",
                                                       "buffer_bytes", "buckets", "collective_calls",
                                                       "peak_rss_bytes", "tensors", "phase_seconds", "bytes_read",
                                                       "read_seconds", "whole_tensors")}
    return {"method": method, "rank": strategy.rank, "is_source": strategy.topology.is_source,
            "node": strategy.topology.node_index, "model_bytes": disk, "chars_read": chars_read,
            "disk_read_bytes": disk_read, "init_report": init_report,
            "total_s": total_s, "distribute_s": distribute_s,
            "distribute_wall": [distribute_end - distribute_s, distribute_end], "bytes_received": counts["bytes_received"],
            "shard_bytes": shard_bytes, "collective_calls": counts["calls"], "calls_by_name": counts["by_name"],
            "peak_rss_bytes": peak, "wrong_tensors": wrong, "wrong_buffers": wrong_buffers}


def worker_main(args) -> None:
    record_rank(lambda: run_method(args.worker, args.model, args.ep, args.bucket_mb, args.collective_timeout),
                results_dir=args.results, prefix=f"{args.worker}-", method=args.worker, last_line_only=True)


# --------------------------------------------------------------------------- driver
MODEL_LAYOUT_SUFFIX = "-model-layout"


def build_checkpoint(model_mb: float, path: str, shard_mb: float | None = None, model_layout: bool = False) -> dict:
    """A synthetic Qwen3-MoE checkpoint in the hub layout (per-expert keys), split into ``shard_mb`` files.

    With ``model_layout``, also a copy in the model's own layout (fused expert tensors) next to it, for
    readers without conversion rules (DCP's HuggingFaceStorageReader).
    """
    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

    hidden, inter, experts, vocab = 512, 512, 8, 4096
    per_layer = (experts * 3 * hidden * inter + 4 * hidden * hidden) * 4
    layers = max(1, round((model_mb * 2**20 - 2 * vocab * hidden * 4) / per_layer))
    if model_mb < 50:
        hidden, inter, vocab, layers = 256, 256, 2048, max(1, round(model_mb / 7))
    save_tiny_checkpoint("qwen3_moe", path, hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                         num_layers=layers, vocab_size=vocab,
                         max_shard_size=f"{int(shard_mb)}MB" if shard_mb else None)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    if model_layout:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        out = path + MODEL_LAYOUT_SUFFIX
        os.makedirs(out, exist_ok=True)
        limit, part, parts = (shard_mb or 1e9) * 2**20, {}, []
        for key, tensor in state.items():
            part[key] = tensor.contiguous()
            if sum(t.numel() * t.element_size() for t in part.values()) >= limit:
                parts.append(part)
                part = {}
        parts += [part] if part else []
        for i, part in enumerate(parts):
            save_file(part, os.path.join(out, f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"),
                      metadata={"format": "pt"})
        del state
    return {"hidden": hidden, "moe_intermediate": inter, "experts": experts, "layers": layers, "vocab": vocab,
            "checkpoint_mb": size / 2**20, "files": len(files)}


def run_launch(method, model, nnodes, nproc, ep, bucket_mb, results_dir, timeout, collective_timeout):
    from twinkle_strategy.train.launcher import run_simulated_nodes

    os.makedirs(results_dir, exist_ok=True)
    script = [os.path.abspath(__file__), "--worker", method, "--model", model, "--ep", str(ep),
              "--bucket-mb", str(bucket_mb), "--results", results_dir,
              "--collective-timeout", str(collective_timeout)]
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
    # Ranks that died without writing a result (e.g. a C++ abort inside gloo): keep what their logs say.
    missing = sorted(set(range(nnodes * nproc)) - {r["rank"] for r in ranks})
    log_lines = []
    if missing:
        for path in result.log_paths:
            with open(path, errors="replace") as f:
                log_lines += [line.strip() for line in f if "what():" in line or line.strip().startswith("rank ")
                              or "traceback : Signal" in line]
    return {"method": method, "nnodes": nnodes, "ok": result.ok, "timed_out": result.timed_out,
            "wall_s": time.perf_counter() - start, "ranks": ranks, "missing_ranks": missing,
            "crash_log": log_lines[:40]}


def _status(ranks: list[dict], num_ranks: int) -> str:
    rank0 = next((r for r in ranks if r["rank"] == 0), None)
    wrong, wrong_buffers = rank0["wrong_tensors"], rank0["wrong_buffers"]
    parts = []
    if wrong:
        experts = sum(".experts." in k for k in wrong)
        parts.append(f"WRONG: {len(wrong)} tensors differ ({experts} of them expert tensors; e.g. {wrong[0]})")
    if wrong_buffers:
        bad_ranks = sorted({int(b.rsplit("@rank", 1)[1]) for b in wrong_buffers})
        parts.append(f"WRONG: {len(wrong_buffers)} buffers differ on rank(s) {bad_ranks}")
    return "; ".join(parts) or "correct"


def summarize(run: dict) -> dict:
    ranks = [r for r in run["ranks"] if "error" not in r]
    failed = [r for r in run["ranks"] if "error" in r]
    missing = run.get("missing_ranks", [])
    if failed or missing or run["timed_out"] or not ranks:
        import re

        def short(text: str) -> str:  # drop gloo's source paths and the generic advice after them
            text = re.sub(r"\[[^\]]*/[^\]]*\]\s*", "", text.split("\n")[0])
            return text.split(". This is typically")[0].split(" Is there a distributed")[0][:160]

        parts = []
        if missing:
            what = next((line.split("what():", 1)[1].strip() for line in run.get("crash_log", [])
                         if "what():" in line), "no result written")
            # torchrun's failure summary: "rank : N (local_rank: i)" then "traceback : Signal 6 (SIGABRT) ...".
            signals: dict[str, list[int]] = {}
            last_rank = None
            for line in run.get("crash_log", []):
                if line.startswith("rank ") and ":" in line:
                    last_rank = int(line.split(":", 1)[1].split()[0])
                elif "traceback : Signal" in line and last_rank in missing:
                    signals.setdefault(line.split("(", 1)[1].split(")", 1)[0], []).append(last_rank)
            how = ", ".join(f"{sorted(set(rs))} {sig}" for sig, rs in sorted(signals.items()))
            parts.append(f"rank(s) {missing} died without a result ({how or 'see node logs'}; "
                         f"the abort: {short(what)})")
        by_error: dict[str, list[int]] = {}
        for r in failed:
            by_error.setdefault(short(r["error"]), []).append(r["rank"])
        parts += [f"rank(s) {sorted(rs)} raised {e}" for e, rs in by_error.items()]
        if run["timed_out"]:
            parts.append(f"timed out; {len(ranks)} rank(s) finished")
        return {"method": run["method"], "nnodes": run["nnodes"], "status": "FAILED: " + "; ".join(parts)}
    non_source = [r for r in ranks if not r["is_source"]] or ranks
    source = [r for r in ranks if r["is_source"]] or ranks
    ratio = [r["bytes_received"] / r["shard_bytes"] for r in non_source]
    incoming = [(r["bytes_received"] + r["disk_read_bytes"]) / r["shard_bytes"] for r in non_source]
    row = {
        "method": run["method"], "nnodes": run["nnodes"], "status": _status(ranks, len(run["ranks"])),
        "init_s_runs": run.get("init_s_runs", []),
        "init_s": max(r["total_s"] for r in ranks),
        # From the moment the last rank enters the distribution step to the moment the last rank leaves it
        # (the same wall clock: every simulated node is this machine). Time a rank spends in the step
        # waiting for slower ranks to arrive is not counted here; it is in init s.
        "distribute_s": max(r["distribute_wall"][1] for r in ranks) - max(r["distribute_wall"][0] for r in ranks),
        "distribute_s_max_rank": max(r["distribute_s"] for r in ranks),
        "recv_mb_min": min(r["bytes_received"] for r in ranks) / 2**20,
        "recv_mb_max": max(r["bytes_received"] for r in ranks) / 2**20,
        "shard_mb_min": min(r["shard_bytes"] for r in ranks) / 2**20,
        "shard_mb_max": max(r["shard_bytes"] for r in ranks) / 2**20,
        "recv_over_shard_min": min(ratio), "recv_over_shard_max": max(ratio),
        "in_over_shard_max": max(incoming),
        "calls_max": max(r["collective_calls"] for r in ranks),
        "rss_source_mb": max(r["peak_rss_bytes"] for r in source) / 2**20,
        "rss_nonsource_mb": max(r["peak_rss_bytes"] for r in non_source) / 2**20,
    }
    model = ranks[0]["model_bytes"]
    row["rss_source_over_model"] = row["rss_source_mb"] * 2**20 / model
    row["rss_gap_over_model"] = (row["rss_source_mb"] - row["rss_nonsource_mb"]) * 2**20 / model
    # Disk: bytes each node's ranks read, over the bytes that node's ranks keep (its share of the model).
    nodes = sorted({r["node"] for r in ranks})
    per_node = [(sum(r["disk_read_bytes"] for r in ranks if r["node"] == n),
                 sum(r["shard_bytes"] for r in ranks if r["node"] == n)) for n in nodes]
    row["disk_node_mb_max"] = max(read for read, _ in per_node) / 2**20
    row["disk_node_over_share"] = max(read / share for read, share in per_node)
    if run["method"] == "ours_stream":  # the InitReport's count next to what the kernel saw read() return
        row["chars_read_over_reported"] = max(r["chars_read"] / max(r["disk_read_bytes"], 1) for r in source)
    reports = [r for r in ranks if r.get("init_report")]
    if reports:  # ours: the InitReport next to the counting wrapper, per rank
        row["init_report_check"] = [
            {"rank": r["rank"], "report_bytes_received": r["init_report"]["bytes_received"],
             "counter_bytes_received": r["bytes_received"], "report_calls": r["init_report"]["collective_calls"],
             "counter_calls": r["collective_calls"], "report_shard_bytes": r["init_report"]["shard_bytes"],
             "shard_bytes": r["shard_bytes"], "report_buffer_bytes": r["init_report"]["buffer_bytes"],
             "transfer_s": r["init_report"]["phase_seconds"].get("transfer")}
            for r in sorted(reports, key=lambda r: r["rank"])]
    return row


def markdown(rows: list[dict]) -> str:
    head = ("| method | nodes | result | init s (median; range) | distribute s | disk read per node / node's share (max) "
            "| peak RSS source / model | (source - non-source) RSS / model | network recv / shard (non-source, max) "
            "| network + disk in / shard (non-source, max) | collective calls (max/rank) | peak RSS source MiB "
            "| peak RSS non-source MiB |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if "init_s" not in r:
            lines.append(f"| {r['method']} | {r['nnodes']} | {r['status']} |" + "  |" * 10)
            continue
        runs = r.get("init_s_runs") or []
        spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
        lines.append(f"| {r['method']} | {r['nnodes']} | {r['status']} | {r['init_s']:.2f}{spread} | {r['distribute_s']:.2f} "
                     f"| {r['disk_node_over_share']:.2f} | {r['rss_source_over_model']:.2f} "
                     f"| {r['rss_gap_over_model']:.2f} | {r['recv_over_shard_max']:.2f} | {r['in_over_shard_max']:.2f} "
                     f"| {r['calls_max']} | {r['rss_source_mb']:.0f} | {r['rss_nonsource_mb']:.0f} |")
    return "\n".join(lines)


OURS_BEST = "ours_stream"
RATIO_COLUMNS = (("init_s", "init s"), ("distribute_s", "distribute s"),
                 ("disk_node_over_share", "disk read per node / node's share"),
                 ("rss_source_over_model", "peak RSS source / model"),
                 ("rss_gap_over_model", "(source - non-source) peak RSS / model"),
                 ("in_over_shard_max", "bytes in (network + disk) / shard, non-source max"),
                 ("calls_max", "collective calls (max/rank)"), ("rss_nonsource_mb", "peak RSS non-source MiB"))


def ratios(rows: list[dict], nnodes: int) -> str:
    ours = next((r for r in rows if r["method"] == OURS_BEST and "init_s" in r and r["nnodes"] == nnodes), None)
    if ours is None:
        return f"({OURS_BEST} has no result at {nnodes} nodes)"
    # Every other method: the peers users would pick, and our own in-memory and every-rank-loads paths.
    others = [r for r in rows if r["method"] != OURS_BEST and "init_s" in r and r["nnodes"] == nnodes]
    correct = [r for r in others if r["status"] == "correct"]
    out = [f"| column | {OURS_BEST} | best other, any result | ours / it | best correct other | ours / it |",
           "|---|---|---|---|---|---|"]
    for key, label in RATIO_COLUMNS:
        cells = []
        for group in (others, correct):
            if not group:
                cells += ["-", "-"]
                continue
            best = min(group, key=lambda r: r[key])
            cells += [f"{best[key]:.3g} ({best['method']})", f"{ours[key] / (best[key] or 1e-9):.2f}"]
        out.append(f"| {label} | {ours[key]:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def scaling_table(rows: list[dict]) -> str:
    nodes = sorted({r["nnodes"] for r in rows})
    if len(nodes) < 2:
        return ""
    out = [f"| nodes x 2 ranks | {OURS_BEST} init s | fastest correct other (init s) | ours / it "
           f"| {OURS_BEST} disk per node / share | {OURS_BEST} (source - non-source) RSS / model |",
           "|---|---|---|---|---|---|"]
    for n in nodes:
        ours = next((r for r in rows if r["method"] == OURS_BEST and r["nnodes"] == n and "init_s" in r), None)
        others = [r for r in rows if r["method"] != OURS_BEST and r["nnodes"] == n and r.get("status") == "correct"]
        if ours is None or not others:
            out.append(f"| {n} | {'-' if ours is None else ours['status']} | | | | |")
            continue
        best = min(others, key=lambda r: r["init_s"])
        out.append(f"| {n} | {ours['init_s']:.2f} | {best['init_s']:.2f} ({best['method']}) "
                   f"| {ours['init_s'] / best['init_s']:.2f} | {ours['disk_node_over_share']:.2f} "
                   f"| {ours['rss_gap_over_model']:.2f} |")
    return "\n".join(out)


def cross_check(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        for c in r.get("init_report_check", []):
            lines.append(f"| {r['nnodes']} | {c['rank']} | {c['report_bytes_received']} | {c['counter_bytes_received']} "
                         f"| {c['report_calls']} | {c['counter_calls']} | {c['report_shard_bytes']} | {c['shard_bytes']} "
                         f"| {c['transfer_s']:.2f} |")
    if not lines:
        return ""
    return "\n".join([("| nodes | rank | InitReport bytes_received | counted bytes | InitReport collective_calls "
                       "| counted calls | InitReport shard_bytes | local shard bytes | transfer phase s |"),
                      "|---|---|---|---|---|---|---|---|---|", *lines])


def chart(rows: list[dict], path: str, nnodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    failed = [r["method"] for r in rows if "init_s" not in r and r["nnodes"] == nnodes]
    rows = [r for r in rows if "init_s" in r and r["nnodes"] == nnodes]
    names = [r["method"] for r in rows]
    panels = (("init_s", "whole init (s)"), ("disk_node_over_share", "disk read per node / node's share"),
              ("rss_source_over_model", "peak RSS source / model"),
              ("in_over_shard_max", "bytes in (network + disk) / shard\nnon-source rank"),
              ("calls_max", "collective calls per rank"), ("rss_nonsource_mb", "peak RSS non-source (MiB)"))
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        bars = ax.bar(names, [r[key] for r in rows],
                      color=["tab:green" if n == OURS_BEST else "tab:gray" for n in names])
        for bar, r in zip(bars, rows, strict=True):
            if r["status"] != "correct":
                bar.set_color("tab:red")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    note = f"; failed (no bars): {', '.join(failed)}" if failed else ""
    fig.suptitle(f"Loading a MoE checkpoint into FSDP2 + EP, {nnodes} simulated nodes x 2 ranks "
                 f"(green: ours, red: finished with wrong weights{note})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=float, default=200, help="checkpoint size (fp32), default 200")
    p.add_argument("--shard-mb", type=float, default=None, help="split the checkpoint into files of this size")
    p.add_argument("--quick", action="store_true", help=f"~20 MB model; {', '.join(QUICK_METHODS)} only (smoke run)")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=32, help="ours: init_bucket_mb")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--scaling", action="store_true", help="also 1, 2, 3 nodes, every method")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per method and node count; the table shows the run with the median init time")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch before every process is killed")
    p.add_argument("--collective-timeout", type=float, default=120,
                   help="process-group timeout in the workers: a peer stuck in a collective fails after this")
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
        return report([summarize(r) for r in saved["runs"]], saved["runs"], saved["checkpoint"], saved["command"],
                      args)
    methods = (args.methods or ",".join(QUICK_METHODS if args.quick else METHODS)).split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    model_mb = 20 if args.quick else args.model_mb
    work = tempfile.mkdtemp(prefix="init_bench-")
    ckpt = os.path.join(work, "model")
    shape = build_checkpoint(model_mb, ckpt, args.shard_mb, model_layout="dcp_hf" in methods)
    print(f"checkpoint: {shape} (work dir {work})", flush=True)
    plan = [(m, args.nnodes) for m in methods]
    if args.scaling:
        plan += [(m, n) for n in (1, 2, 3) for m in methods if (m, n) not in plan]
    runs = []
    for method, nnodes in plan:
        attempts = []
        for attempt in range(args.repeat):
            print(f"running {method} ({nnodes} nodes x {args.nproc_per_node}, run {attempt + 1})...", flush=True)
            run = run_launch(method, ckpt, nnodes, args.nproc_per_node, args.ep, args.bucket_mb,
                             os.path.join(work, f"{method}-{nnodes}-{attempt}"), args.timeout,
                             args.collective_timeout)
            status = summarize(run)["status"]
            print(f"  {status} ({run['wall_s']:.0f} s with process start-up)", flush=True)
            attempts.append(run)
            if "init_s" not in summarize(run):
                break  # a method that fails, fails every time: no point in repeating it
        # Timings on a shared machine vary between runs: report the run with the median whole-init time.
        timed = sorted((r for r in attempts if "init_s" in summarize(r)), key=lambda r: summarize(r)["init_s"])
        chosen = timed[len(timed) // 2] if timed else attempts[-1]
        chosen["init_s_runs"] = [round(summarize(r)["init_s"], 2) for r in timed]
        runs.append(chosen)
    command = command_line("init_bench.py")
    report([summarize(r) for r in runs], runs, shape, command, args)


def report(rows, runs, shape, command, args) -> None:
    text = (f"Command: `{command}`\n\nCheckpoint: {shape['checkpoint_mb']:.0f} MiB fp32 Qwen3-MoE "
            f"({shape['layers']} layers, {shape['experts']} experts, hidden {shape['hidden']}, "
            f"moe_intermediate {shape['moe_intermediate']}, vocab {shape['vocab']}); "
            f"{args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep={args.ep}, gloo on CPU, "
            f"{os.cpu_count()} CPU cores, {shape.get('files', 1)} safetensors files, init_bucket_mb={args.bucket_mb}."
            f"\n\n{markdown(rows)}\n")
    for nnodes in sorted({r["nnodes"] for r in rows}):
        text += (f"\nRatios at {nnodes} node(s), {OURS_BEST} / the best other method on each column (lower is "
                 f"better for every column):\n\n{ratios(rows, nnodes)}\n")
    scaling = scaling_table(rows)
    if scaling:
        text += f"\nScaling (same checkpoint, 2 ranks per node):\n\n{scaling}\n"
    check = cross_check(rows)
    if check:
        text += f"\nOurs: InitReport next to the counting wrapper (counted calls include from_pretrained's " \
                f"config broadcast and its fail-together checks):\n\n{check}\n"
    print(text)
    write_results(args.out, "init_bench", text=text,
                  payload={"command": command, "checkpoint": shape, "rows": rows, "runs": runs})
    chart(rows, os.path.join(args.out, "init_bench.png"), args.nnodes)
    print(f"wrote {args.out}/init_bench.png")


if __name__ == "__main__":
    main()
