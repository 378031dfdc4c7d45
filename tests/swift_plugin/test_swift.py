"""`swift sft` (real ms-swift 4.x) with the twinkle plugin, on CPU with gloo; the oracle is plain `swift sft`
in one process.

ms-swift 4.6 needs older transformers/peft than .venv, so it lives in its own virtualenv (constraints-swift.txt),
which ``scripts/swift_env.sh`` creates once per machine outside the checkout (or only checks, when it is there;
``scripts/venv_path.sh swift`` prints where). It holds the dependencies; this package comes from this checkout
on PYTHONPATH (SWIFT_ENV), in every process run with it. Each run
is `NPROC_PER_NODE=2 swift sft --external_plugins twinkle_strategy/integrations/swift/plugin.py
tests/workers/swift_probe_plugin.py --callbacks twinkle_probe ...` on the tiny Qwen3-MoE with
EP=2 and LoRA on attention and experts; the probe callback records, at the end of training, the
distributed model's logits on fixed tokens and each rank's memory_efficient_init report.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from launch_log import launch_group
from multinode import launch_env
from preload import forked_python, outcomes, swift_command, swift_python
from workers.swift_peft_logits import peft_logits

from twinkle_strategy.train.ports import MasterPortTaken, master_port_taken, on_a_free_port

REPO = Path(__file__).resolve().parents[2]
# What every process of the swift virtualenv gets: this checkout's package first on the path.
SWIFT_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
PLUGIN = REPO / "twinkle_strategy" / "integrations" / "swift" / "plugin.py"
WORKERS = REPO / "tests" / "workers"
PROBE = WORKERS / "swift_probe_plugin.py"
REFERENCE = WORKERS / "swift_reference_plugin.py"
DATASET = REPO / "examples" / "data" / "demo_sft.jsonl"
MAX_STEPS = 10
BF16_AUX_TOLERANCE = 8 * 2.0 ** -8  # relative: swift logs the model's own bf16 aux loss, as TRL (see test_trl.py)

LORA_ARGS = ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0",
             "--target_modules", "q_proj", "v_proj",
             "--target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BATCH_2 = ["--per_device_train_batch_size", "2"]


def _tail(text: str, n: int = 8000) -> str:
    lines = [line for line in text.splitlines() if "is ignored: it is neither a file" not in line]
    return "\n".join(lines)[-n:]


def launch_swift_sft(swift_bin: Path, model: Path, out: Path, extra: list[str], env: dict[str, str],
                     nnodes: int = 1, timeout: float = 420, reference: bool = False, *, dataset: Path = DATASET,
                     template: str = "qwen3_nothinking", probe: bool = True) -> tuple[list, str, list[Path]]:
    """Start `swift sft` with 2 processes per node (``nnodes`` simulated nodes on this machine, each its own
    `swift sft` as on a cluster) and wait; returns the exit codes (None: killed after ``timeout``), the
    combined log and the log files. ``reference``: plain `swift sft` in one process, no twinkle plugin.
    ``probe=False``: the twinkle plugin without the probe callback."""
    plugins = ["--external_plugins", str(REFERENCE), "--callbacks", "twinkle_reference"] if reference else \
        ["--external_plugins", str(PLUGIN), str(PROBE), "--callbacks", "twinkle_probe"] if probe else \
        ["--external_plugins", str(PLUGIN)]
    cmd = ["sft", *plugins, "--model", str(model), "--template", template,
           "--dataset", str(dataset), "--torch_dtype", "float32", "--max_steps", str(MAX_STEPS),
           "--learning_rate", "5e-3", "--logging_steps", "1", "--save_steps", "5",
           "--output_dir", str(out / "output"), "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
           "--report_to", "none", "--check_model", "false", *extra]
    if reference:  # one process, no torchrun, no port
        return _start_and_wait_swift_sft(swift_bin, cmd, out, env, nnodes, timeout, reference, port="")
    # swift's torchrun cannot bind port 0, so a port picked free may be taken before it binds it: pick again.
    return on_a_free_port(lambda port, retry: _start_and_wait_swift_sft(swift_bin, cmd, out, env, nnodes, timeout,
                                                                       reference, port=str(port),
                                                                       retry_if_port_taken=retry))


def _start_and_wait_swift_sft(swift_bin: Path, args: list[str], out: Path, env: dict[str, str], nnodes: int,
                              timeout: float, reference: bool, *, port: str, retry_if_port_taken: bool = False):
    with launch_group("swift sft") as record:  # its nodes are one launch in the launch table (tests/launch_log.py)
        returncodes, logs = _run_nodes(swift_bin, args, out, env, nnodes, timeout, reference, port=port,
                                       retry_if_port_taken=retry_if_port_taken, record=record)
    log = "\n".join(f"--- node {i} ---\n" + path.read_text(errors="replace") for i, path in enumerate(logs))
    return returncodes, log, logs


def _run_nodes(swift_bin: Path, args: list[str], out: Path, env: dict[str, str], nnodes: int, timeout: float,
               reference: bool, *, port: str, retry_if_port_taken: bool, record) -> tuple[list, list[Path]]:
    procs, logs, preload_log = [], [], None
    for node in range(nnodes):
        # launch_env: what every launch's ranks get, so that ranks fork from the servers multinode.launch starts
        node_env = {**os.environ, **launch_env(out), "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port, "NNODES": str(nnodes), "NODE_RANK": str(node),
                    "TWINKLE_PROBE_OUT": str(out / "probe"), **SWIFT_ENV, **env}
        if reference:  # one process, no torchrun
            for name in ("NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"):
                node_env.pop(name)
        # the launcher, its torchrun agent and its ranks forked; the nodes share one preload log, which the launch
        # table follows to the forked processes (tests/launch_log.py)
        swift, node_env, preload_log = swift_command(swift_bin, node_env, log=preload_log)
        record.preload_log = None if preload_log is None else str(preload_log)
        logs.append(out / f"swift_node{node}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([*swift, *args], env=node_env, cwd=out, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
        if procs[0].poll() not in (None, 0) and master_port_taken(logs[0]) and retry_if_port_taken:
            break  # node 1 would wait for node 0's store until the time limit
        time.sleep(0.5)
    returncodes = [proc.poll() for proc in procs]
    port_taken = retry_if_port_taken and returncodes[0] not in (None, 0) and master_port_taken(logs[0])
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if preload_log is not None:
        record.forked, record.fallbacks = outcomes(preload_log)
        preload_log.unlink(missing_ok=True)
    if port_taken:
        raise MasterPortTaken(f"swift sft's torchrun could not listen on {port}")
    return returncodes, logs


def run_swift_sft(swift_bin: Path, model: Path, out: Path, extra: list[str], env: dict[str, str],
                  nnodes: int = 1, timeout: float = 420, reference: bool = False, **data) -> dict:
    """`launch_swift_sft`, which must succeed; returns its losses, grad norms, run directory and what the probe
    recorded (the reference run records only the final logits). ``data``: ``dataset``, ``template``."""
    returncodes, log, logs = launch_swift_sft(swift_bin, model, out, extra, env, nnodes, timeout, reference, **data)
    assert returncodes == [0] * nnodes, f"swift sft exited with {returncodes} (None: killed after {timeout}s):\n" \
        + "\n".join(_tail(path.read_text(errors="replace"), 6000) for path in logs)
    run_dir, losses, grad_norms = logged_steps(out)
    probe = out / "probe"
    return {
        "log": log,
        "run_dir": Path(run_dir),
        "probe_dir": probe,
        "losses": losses,
        "grad_norms": grad_norms,
        "ranks": {} if reference else {r: json.loads((probe / f"rank{r}.json").read_text()) for r in range(2 * nnodes)},
        "logits": torch.load(probe / "logits.pt"),
    }


def logged_steps(out: Path) -> tuple[str, dict, dict]:
    """The run directory under ``out`` and its per-step losses and gradient norms (swift's logging.jsonl)."""
    (run_dir,) = glob.glob(str(out / "output" / "v0-*"))
    losses, grad_norms = {}, {}
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        for line in f:
            entry = json.loads(line)
            if "loss" in entry and "global_step/max_steps" in entry:
                step = int(entry["global_step/max_steps"].split("/")[0])
                losses[step], grad_norms[step] = entry["loss"], entry["grad_norm"]
    return run_dir, losses, grad_norms


def assert_same_steps(run: dict, ref: dict, atol: float = 1e-5) -> None:
    """Every logged step of ``run`` has the loss and gradient norm of the reference run."""
    for step in ref["losses"]:
        assert abs(run["losses"][step] - ref["losses"][step]) <= atol, (step, run["losses"], ref["losses"])
        assert abs(run["grad_norms"][step] - ref["grad_norms"][step]) <= atol, (step, run["grad_norms"],
                                                                                ref["grad_norms"])


@pytest.fixture(scope="module")
def lora_runs(swift_bin, tiny_model, tmp_path_factory):
    """The same LoRA run with memory_efficient_init (options from TWINKLE_* variables) and without
    (options from the --fsdp JSON); then a resume of the second one from checkpoint-5, with
    memory_efficient_init."""
    runs = {}
    out = tmp_path_factory.mktemp("swift_mem")
    runs["mem"] = run_swift_sft(swift_bin, tiny_model, out, [*BATCH_2, *LORA_ARGS],
                                {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"})
    out = tmp_path_factory.mktemp("swift_plain")
    fsdp = {"fsdp": "full_shard auto_wrap",
            "fsdp_config": {"fsdp_version": 2, "twinkle": {"ep_size": 2, "memory_efficient_init": False}}}
    runs["plain"] = run_swift_sft(swift_bin, tiny_model, out, [*BATCH_2, *LORA_ARGS, "--fsdp", json.dumps(fsdp)],
                                  {"TWINKLE_PROBE_LEGACY_STATE": "1"})  # and the old plugin's state, aside
    out = tmp_path_factory.mktemp("swift_resume")
    checkpoint = runs["plain"]["run_dir"] / "checkpoint-5"
    runs["resume"] = run_swift_sft(swift_bin, tiny_model, out,
                                   [*BATCH_2, *LORA_ARGS, "--resume_from_checkpoint", str(checkpoint)],
                                   {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1",
                                    # the fit check, with a budget just over the plan's peak: it trains
                                    "TWINKLE_DEVICE_MEMORY": str(int(planned_peak(tiny_model) * 1.01))})
    return runs


def planned_peak(model: Path, *, max_length: int = 512) -> int:
    """The plan's step peak of LORA_ARGS + BATCH_2 with ep_size 2 on 2 processes, as the plugin asks it (swift's
    --max_length defaults to the demo's max_position_embeddings, 512; gradient checkpointing is swift's default)."""
    from twinkle_strategy.config import StrategyConfig
    from twinkle_strategy.integrations.swift.parts.fit import plan_request
    from twinkle_strategy.planning import plan_memory

    args = types.SimpleNamespace(tuner_type="lora", lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                 torch_dtype=torch.float32, model_dir=str(model), per_device_train_batch_size=2,
                                 max_length=max_length, gradient_checkpointing=True)
    strategy = StrategyConfig(ep_size=2, memory_efficient_init=True, mixed_precision="no", device_type="cpu")
    request = plan_request(args, strategy, device_type="cpu", device_memory=None, routing_skew=1.0,
                           environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    return plan_memory(request).peak


def test_swift_sft_lora_trains_with_memory_efficient_init(lora_runs, tiny_model):
    run = lora_runs["mem"]
    (options,) = set(re.findall(r"twinkle swift plugin: NativeFSDPStrategy\((.*?)\)", run["log"]))
    assert {"ep_size=2", "memory_efficient_init=True"} <= set(options.split(", ")), options
    losses = [run["losses"][step] for step in range(1, MAX_STEPS + 1)]
    assert all(math.isfinite(loss) and 0 < loss < 20 for loss in losses), losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, f"the loss did not go down: {losses}"
    source, receiver = run["ranks"][0], run["ranks"][1]
    assert source["is_source"] and source["loaded_checkpoint"]
    # Rank 1 never read the checkpoint: it built the model on meta and received exactly its shards.
    assert not receiver["is_source"] and receiver["loaded_checkpoint"] is False
    report = receiver["init_report"]
    assert report["bytes_received"] == report["shard_bytes"] + report["buffer_bytes"] > 0
    assert source["init_report"]["bytes_sent"] == report["bytes_received"]
    # The source streamed: it read from the files its node's shards (one node: all of the checkpoint), once;
    # the LoRA adapters swift added came from its memory.
    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

    checkpoint_bytes = sum(t.nbytes for t in SafetensorsIndex.from_directory(str(tiny_model)).tensors.values())
    assert source["init_report"]["bytes_read"] == checkpoint_bytes
    assert receiver["init_report"]["bytes_read"] == 0
    assert receiver["model_class"].startswith("FSDP")
    # swift's own output layout
    checkpoint = run["run_dir"] / f"checkpoint-{MAX_STEPS}"
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "args.json",
                 "trainer_state/optimizer.json", "trainer_state/rng/rank0.pt", "trainer_state/rng/rank1.pt"):
        assert (checkpoint / name).is_file(), f"{checkpoint} has no {name}"
    assert (run["run_dir"] / "checkpoint-5" / "adapter_model.safetensors").is_file()


def test_swift_sft_trains_in_bf16_with_the_aux_loss_and_logs_the_fp32_aux_loss(swift_bin, tiny_model, tmp_path):
    """`swift sft` as users run a MoE model: --torch_dtype bfloat16 (swift's --bf16 follows it, and the strategy's
    mixed_precision follows that) with the load-balancing loss on (--router_aux_loss_coef 0.01), 3 steps at 1x2
    ep=2 (issue 35: bf16 with the aux loss failed at step 1 in twinkle-sft, HF and TRL). swift adds and logs the
    model's own aux loss of each micro-batch (2 rows); each step's is the same run's in fp32 within
    BF16_AUX_TOLERANCE, 8 u relative, as tests/multiproc/test_trl.py's explains (measured: up to 1.4 u)."""
    runs = {}
    for dtype in ("bfloat16", "float32"):
        out = tmp_path / dtype
        out.mkdir()
        runs[dtype] = run_swift_sft(swift_bin, tiny_model, out, [*BATCH_2, *LORA_ARGS, "--torch_dtype", dtype,
                                                                 "--router_aux_loss_coef", "0.01", "--max_steps", "3"],
                                    {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"})
    bf16, fp32 = runs["bfloat16"], runs["float32"]
    (options,) = set(re.findall(r"twinkle swift plugin: NativeFSDPStrategy\((.*?)\)", bf16["log"]))
    assert {"ep_size=2", "mixed_precision=bf16"} <= set(options.split(", ")), options
    assert sorted(bf16["losses"]) == sorted(fp32["losses"]) == [1, 2, 3], (bf16["losses"], fp32["losses"])
    assert all(math.isfinite(loss) and 0 < loss < 20 for loss in bf16["losses"].values()), bf16["losses"]
    aux = {name: logged_aux_losses(run["run_dir"]) for name, run in runs.items()}
    assert sorted(aux["bfloat16"]) == [1, 2, 3], aux  # the aux loss is on: swift logged it at every step
    for step, low in aux["bfloat16"].items():
        ref = aux["float32"][step]
        assert abs(low - ref) <= BF16_AUX_TOLERANCE * ref, (step, aux)
    print("\nswift bf16 aux loss against fp32: " + ", ".join(
        f"{abs(aux['bfloat16'][s] - aux['float32'][s]) / aux['float32'][s] / 2 ** -8:.2f} u" for s in (1, 2, 3)))


def logged_aux_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "logging.jsonl") as f:
        entries = [json.loads(line) for line in f]
    return {int(e["global_step/max_steps"].split("/")[0]): e["aux_loss"] for e in entries if "aux_loss" in e}


def test_swift_sft_same_losses_without_memory_efficient_init(lora_runs):
    mem, plain = lora_runs["mem"], lora_runs["plain"]
    assert "memory_efficient_init=False" in plain["log"]
    assert plain["ranks"][1]["loaded_checkpoint"] is True and plain["ranks"][1]["init_report"] is None
    assert sorted(mem["losses"]) == sorted(plain["losses"]) == list(range(1, MAX_STEPS + 1))
    for step in mem["losses"]:
        assert abs(mem["losses"][step] - plain["losses"][step]) <= 1e-6, (step, mem["losses"], plain["losses"])
    assert torch.allclose(mem["logits"]["logits"], plain["logits"]["logits"], atol=1e-5)


def test_swift_sft_matches_single_process_plain_swift(lora_runs, swift_bin, tiny_model, tmp_path):
    """The oracle: plain `swift sft` in one process, no twinkle plugin, the same 4 samples per step. The plugin's
    2-rank EP=2 + FSDP2 run with memory_efficient_init logs the same loss and gradient norm at every step and
    ends with the same model."""
    ref = run_swift_sft(swift_bin, tiny_model, tmp_path, ["--per_device_train_batch_size", "4", *LORA_ARGS], {},
                        reference=True)
    assert "twinkle swift plugin" not in ref["log"]
    mem = lora_runs["mem"]
    assert sorted(ref["losses"]) == sorted(mem["losses"]) == list(range(1, MAX_STEPS + 1))
    assert_same_steps(mem, ref)
    diff = (mem["logits"]["logits"] - ref["logits"]["logits"]).abs().max()
    assert diff <= 1e-4, diff


def test_swift_sft_full_parameters_match_single_process(swift_bin, tiny_model, tmp_path):
    """`--tuner_type full`: every weight trains (experts EP-sliced and FSDP-sharded); losses and gradient norms
    equal plain single-process `swift sft`, and the full checkpoint swift writes equals the reference's."""
    from safetensors.torch import load_file

    full = ["--tuner_type", "full", "--max_steps", "4", "--save_steps", "4", "--learning_rate", "1e-4"]
    (tmp_path / "ref").mkdir()
    (tmp_path / "mem").mkdir()
    ref = run_swift_sft(swift_bin, tiny_model, tmp_path / "ref", ["--per_device_train_batch_size", "4", *full], {},
                        reference=True)
    mem = run_swift_sft(swift_bin, tiny_model, tmp_path / "mem", [*BATCH_2, *full],
                        {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"})
    assert mem["ranks"][1]["loaded_checkpoint"] is False
    assert sorted(ref["losses"]) == sorted(mem["losses"]) == [1, 2, 3, 4]
    assert_same_steps(mem, ref)
    saved = load_file(str(mem["run_dir"] / "checkpoint-4" / "model.safetensors"))
    expected = load_file(str(ref["run_dir"] / "checkpoint-4" / "model.safetensors"))
    assert sorted(saved) == sorted(expected)
    assert any("experts" in name for name in saved)
    original = load_file(str(tiny_model / "model.safetensors"))
    for name, tensor in expected.items():
        assert saved[name].shape == tensor.shape, name
        assert torch.allclose(saved[name], tensor, atol=1e-5), (name, (saved[name] - tensor).abs().max())
    # (the tiny checkpoint stores experts one by one, as the hub's Qwen3-MoE does; swift saves them fused)
    assert max((expected[n] - original[n]).abs().max() for n in set(expected) & set(original)) > 1e-4, \
        "nothing was trained"
    assert (mem["logits"]["logits"] - ref["logits"]["logits"]).abs().max() <= 1e-4


def long_answers(path: Path) -> Path:
    """The demo's conversations with answers four times as long (four demo answers each): packed rows of them are
    cut inside answers, where a chunk's first label is one to learn."""
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()]
    chats = [r["messages"] for r in rows if "messages" in r]
    with open(path, "w") as f:
        for i in range(0, len(chats) - 3, 3):
            answer = " ".join(chat[1]["content"] for chat in chats[i:i + 4])
            f.write(json.dumps({"messages": [chats[i][0], {"role": "assistant", "content": answer}]}) + "\n")
    return path


def test_swift_sft_packing_with_sequence_parallel_logs_the_losses_of_the_run_without_it(swift_bin, tiny_model, tmp_path):
    """`--packing true --sequence_parallel_size 2` on the demo model (LoRA on attention and experts, EP=2, 2 ranks):
    swift packs the rows (sdpa, no flash attention), the strategy's Ulysses splits them (swift's own sequence
    parallelism is never built), and every step logs the loss and gradient norm of the same run without
    --sequence_parallel_size (fp32). The two ranks of the group share their examples (one data-parallel rank, as in
    swift's own SP): 2 packs per device there, 1 in the run without SP, the same global batch. Long answers, so that
    rows are cut where the first label of a chunk counts."""
    common = [*LORA_ARGS, "--packing", "true", "--max_length", "96", "--max_steps", "3", "--save_steps", "3",
              "--gradient_accumulation_steps", "2"]
    dataset = long_answers(tmp_path / "long_answers.jsonl")
    runs = {}
    for name, extra in (("sp", ["--sequence_parallel_size", "2", "--per_device_train_batch_size", "2"]),
                        ("ref", ["--per_device_train_batch_size", "1"])):
        (tmp_path / name).mkdir()
        returncodes, log, logs = launch_swift_sft(swift_bin, tiny_model, tmp_path / name, [*common, *extra],
                                                  {"TWINKLE_EP_SIZE": "2"}, probe=False, dataset=dataset)
        assert returncodes == [0], "\n".join(_tail(path.read_text(errors="replace"), 6000) for path in logs)
        _, losses, grad_norms = logged_steps(tmp_path / name)
        runs[name] = {"log": log, "losses": losses, "grad_norms": grad_norms}
    (options,) = set(re.findall(r"twinkle swift plugin: NativeFSDPStrategy\((.*?)\)", runs["sp"]["log"]))
    assert "sequence_parallel_size=2" in options.split(", "), options
    # swift's own sequence parallelism stays off (args.json records swift's arguments): no second set of groups.
    (run_dir,) = glob.glob(str(tmp_path / "sp" / "output" / "v0-*"))
    swift_args = json.loads((Path(run_dir) / "args.json").read_text())
    assert (swift_args["sequence_parallel_size"], swift_args["packing"]) == (1, True), swift_args
    assert sorted(runs["sp"]["losses"]) == sorted(runs["ref"]["losses"]) == [1, 2, 3]
    assert_same_steps(runs["sp"], runs["ref"])


def test_swift_sft_fit_check_passes_a_budget_just_over_the_plan(lora_runs):
    """The resume launch ran with TWINKLE_DEVICE_MEMORY 1% over the plan's peak: planned, fits, trained."""
    (line,) = set(re.findall(r"twinkle swift plugin: memory plan: (.*)", lora_runs["resume"]["log"]))
    assert line.startswith("fits: step peak "), line


@pytest.fixture(scope="module")
def parse_refusals(swift_bin, tiny_model, tmp_path_factory) -> dict:
    """The refusals the plugin makes while swift parses its arguments, in one process of swift's Python
    (tests/workers/swift_refusals.py: `swift sft`'s own entry point, once per case): "fit", a budget
    (TWINKLE_DEVICE_MEMORY) 1% under the plan's peak of 2 processes on a model whose weights file is garbage;
    "deepspeed", --deepspeed zero3. Each case's output (its log and traceback) by name, with the budget and peak."""
    from twinkle_strategy.planning.report import gib

    root = tmp_path_factory.mktemp("swift_parse_refusals")
    model = root / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    peak = planned_peak(tiny_model)
    budget = int(peak * 0.99)
    common = ["--template", "qwen3_nothinking", "--dataset", str(DATASET), "--report_to", "none", "--check_model", "false",
              "--dataset_num_proc", "1"]
    cases = [{"name": "fit", "argv": ["--external_plugins", str(PLUGIN), "--model", str(model), *common,
                                      "--torch_dtype", "float32", "--output_dir", str(root / "fit"), *BATCH_2,
                                      *LORA_ARGS],
              # the world of `NPROC_PER_NODE=2 swift sft` as each rank's parsing sees it (no process group yet)
              "env": {"TWINKLE_EP_SIZE": "2", "TWINKLE_DEVICE_MEMORY": str(budget), "WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "2"}},
             {"name": "deepspeed", "argv": ["--external_plugins", str(PLUGIN), "--model", str(tiny_model), *common,
                                            "--output_dir", str(root / "deepspeed"), "--deepspeed", "zero3"],
              "env": {}}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **SWIFT_ENV}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(swift_bin / "python"), "-u", str(WORKERS / "swift_refusals.py"), json.dumps(cases)],
                          env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, _tail(proc.stdout)
    sections = re.split(r"^=== case (\w+)\n", proc.stdout, flags=re.M)[1:]
    outputs = dict(zip(sections[::2], sections[1::2], strict=True))
    assert sorted(outputs) == ["deepspeed", "fit"], _tail(proc.stdout)
    return {"outputs": outputs, "peak": gib(peak), "budget": gib(budget)}


def test_swift_sft_fit_check_refuses_a_budget_just_under_the_plan_before_any_weight_is_read(parse_refusals):
    """TWINKLE_DEVICE_MEMORY 1% under the plan's peak of 2 processes: a rank refuses in one line (peak, budget,
    first fix) while swift parses its arguments. The weights file is garbage, so a rank that opened it would fail
    otherwise. (Each rank parses alone, before any process group: one process parsing as a rank of 2 is the case.)"""
    log = parse_refusals["outputs"]["fit"]
    assert log.rstrip().endswith("=== exit fit 1"), _tail(log)
    refusals = [line for line in log.splitlines()
                if line.startswith("twinkle_strategy.integrations.swift.errors.SwiftPluginError")]
    assert len(refusals) == 1, _tail(log)
    said = (f"twinkle_strategy.integrations.swift.errors.SwiftPluginError: the memory plan's step peak "
            f"{parse_refusals['peak']} per device exceeds the budget {parse_refusals['budget']} (TWINKLE_DEVICE_MEMORY, "
            "else the GPU's memory); first fix: ")
    assert refusals[0].startswith(said), (refusals[0], said)
    # The fix as swift takes it: a flag and its value (`--sequence_parallel_size 2`) or a variable (`NNODES=2`).
    assert re.fullmatch(r"(--\w+ \S+|[A-Z_]+=\S+)( \([^)]*\))? \(peak [0-9.]+ [GM]iB\); twinkle-sft plan shows "
                        r"every part; TWINKLE_SKIP_PLAN=1 launches anyway", refusals[0][len(said):]), refusals[0]
    # refused while parsing: no strategy built, the weights never opened
    assert "_init_fsdp" in log and "NativeFSDPStrategy(" not in log and "CheckpointError" not in log, _tail(log)


def test_swift_sft_resume_continues_exactly(lora_runs):
    resumed, plain = lora_runs["resume"], lora_runs["plain"]
    assert sorted(resumed["losses"]) == list(range(6, MAX_STEPS + 1)), resumed["losses"]
    for step, loss in resumed["losses"].items():
        assert abs(loss - plain["losses"][step]) <= 1e-5, (step, resumed["losses"], plain["losses"])


def test_swift_sft_reads_an_older_twinkle_state_once(lora_runs, swift_bin, tiny_model, tmp_path):
    """A checkpoint as the plugin before its rebuild wrote it (per-rank twinkle_state/, no trainer_state/)
    resumes at the same layout with the same losses, announced by one deprecation line; the next save is
    the library's trainer_state/."""
    plain = lora_runs["plain"]
    old = tmp_path / "checkpoint-5"
    shutil.copytree(plain["run_dir"] / "checkpoint-5", old, ignore=shutil.ignore_patterns("trainer_state"))
    shutil.copytree(plain["probe_dir"] / "legacy" / "checkpoint-5", old, dirs_exist_ok=True)
    assert sorted(p.name for p in (old / "twinkle_state").iterdir()) == ["rank0.pt", "rank1.pt"]
    (tmp_path / "run").mkdir()
    resumed = run_swift_sft(swift_bin, tiny_model, tmp_path / "run",
                            [*BATCH_2, *LORA_ARGS, "--resume_from_checkpoint", str(old)], {"TWINKLE_EP_SIZE": "2"})
    assert resumed["log"].count("holds twinkle_state/ (an older version's per-rank state") == 1, \
        _tail(resumed["log"], 6000)
    assert sorted(resumed["losses"]) == list(range(6, MAX_STEPS + 1)), resumed["losses"]
    for step, loss in resumed["losses"].items():
        assert abs(loss - plain["losses"][step]) <= 1e-5, (step, resumed["losses"], plain["losses"])
        assert abs(resumed["grad_norms"][step] - plain["grad_norms"][step]) <= 1e-5, step
    final = resumed["run_dir"] / f"checkpoint-{MAX_STEPS}"
    assert (final / "trainer_state").is_dir() and not (final / "twinkle_state").exists()


def _normalized_json(path: Path, run_dir: Path) -> object:
    """A JSON file of a checkpoint with its run's own directory (and the test's) replaced by placeholders."""
    return json.loads(path.read_text().replace(str(run_dir), "<run>").replace(str(run_dir.parent.parent), "<out>"))


WALL_CLOCK = ("elapsed_time", "remaining_time", "train_speed(s/it)", "memory(GiB)", "tokens_per_second",
              "tflops_per_device", "mfu", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def swift_checkpoint_differences(swift_bin: Path, pairs: list[tuple[Path, Path]]) -> list[tuple[list[str], int]]:
    """For each (sync, background) pair of swift checkpoints: the files of ``background`` that differ from
    ``sync``'s (or exist in one only), and how many were compared. Byte for byte, except where a run writes its own
    directory or the wall clock: args.json and training_args.bin with the run directories replaced,
    trainer_state.json without its wall-clock log fields; and adapter_config.json with its lists sorted (PEFT
    writes sets such as target_modules as lists in the process's string-hash order, which differs between any two
    runs). Every training_args.bin is read by one process of swift's Python (swift's own arguments class)."""
    bins = [p for pair in pairs for p in pair if (p / "training_args.bin").is_file()]
    code = ("import json, sys, torch\n"
            "for d in sys.argv[1:]:\n"
            "    a = torch.load(d + '/training_args.bin', weights_only=False); run = d.rsplit('/', 1)[0]\n"
            "    print(json.dumps(a.to_dict(), default=str).replace(run, '<run>').replace(run.rsplit('/', 2)[0], "
            "'<out>'))\n")
    loaded = {}
    if bins:
        python, env = swift_python(swift_bin, {**os.environ, **SWIFT_ENV})  # forked from its preload server
        proc = subprocess.run([python, "-c", code, *map(str, bins)], check=True,
                              capture_output=True, text=True, timeout=120, env=env)
        loaded = dict(zip(bins, map(json.loads, proc.stdout.strip().splitlines()), strict=True))
    return [_checkpoint_differences(sync, background, loaded) for sync, background in pairs]


def _checkpoint_differences(sync: Path, background: Path, training_args: dict[Path, dict]) -> tuple[list[str], int]:
    names = {str(p.relative_to(d)) for d in (sync, background) for p in d.rglob("*") if p.is_file()}
    different = []
    for name in sorted(names):
        a, b = sync / name, background / name
        if not (a.is_file() and b.is_file()):
            different.append(name)
        elif name == "args.json":
            if _normalized_json(a, sync.parent) != _normalized_json(b, background.parent):
                different.append(name)
        elif name == "training_args.bin":
            if training_args[sync] != training_args[background]:
                different.append(name)
        elif name == "adapter_config.json":
            configs = [{k: sorted(v, key=str) if isinstance(v, list) else v for k, v in json.loads(p.read_text()).items()}
                       for p in (a, b)]
            if configs[0] != configs[1]:
                different.append(name)
        elif name == "trainer_state.json":
            states = [json.loads(p.read_text()) for p in (a, b)]
            for state in states:
                state["log_history"] = [{k: v for k, v in e.items() if k not in WALL_CLOCK} for e in state["log_history"]]
            if states[0] != states[1]:
                different.append(name)
        elif a.read_bytes() != b.read_bytes():
            different.append(name)
    return different, len(names)


def test_swift_sft_async_save_overlaps_training_and_writes_the_synchronous_files(lora_runs, swift_bin, tiny_model,
                                                                                  tmp_path_factory):
    """TWINKLE_ASYNC_SAVE=1: the writers pause mid-file in checkpoint-5 until step 6 has begun, so step 6 starts
    before any of its files is durable (the writers' own timestamps); both checkpoints equal the synchronous run's
    (lora_runs' "mem", the same arguments), and swift's last-checkpoint link points at the last one."""
    from workers.save_writer_pause import PAUSE_ENV  # the probe plugin pauses each rank's writer as it asks

    out = tmp_path_factory.mktemp("swift_asyn")  # (as long a path as the synchronous run's: see args.json)
    (out / "pause").mkdir()
    run = run_swift_sft(swift_bin, tiny_model, out, [*BATCH_2, *LORA_ARGS],
                        {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1", "TWINKLE_ASYNC_SAVE": "1",
                         PAUSE_ENV: f"checkpoint-5:{out / 'pause'}"})
    sync = lora_runs["mem"]
    assert run["losses"] == sync["losses"] and run["grad_norms"] == sync["grad_norms"]
    for rank, data in run["ranks"].items():
        written = data["writes"]["checkpoint-5"]
        assert written and data["step_starts"]["6"] < min(t["durable"] for t in written.values()), (rank, data)
        assert list(data["writes"]) == ["checkpoint-5", "checkpoint-10"], rank  # the final save awaited in train()
    steps = (5, 10)
    compared = swift_checkpoint_differences(swift_bin, [(sync["run_dir"] / f"checkpoint-{step}",
                                                         run["run_dir"] / f"checkpoint-{step}") for step in steps])
    for step, (different, count) in zip(steps, compared, strict=True):
        assert different == [] and count > 10, (step, different)
    assert os.readlink(run["run_dir"] / "last-checkpoint") == "checkpoint-10"
    assert not list(run["run_dir"].glob("*.tmp"))


@pytest.fixture(scope="module")
def swift_env_peft(lora_runs, vl_all_runs, swift_bin, tiny_model) -> dict[str, str]:
    """Plain PEFT in the swift virtualenv (the older peft/transformers swift runs on) on each saved adapter (the
    LoRA run's and each vision-language family's) against the logits the distributed model gave: one process for
    all. What swift_peft_logits.py printed for each, by "lora" or family."""
    cases = {"lora": (lora_runs["mem"], str(tiny_model), MAX_STEPS)}
    cases |= {family: (runs["mem"], str(runs["model"]), VL_STEPS) for family, runs in vl_all_runs.items()}
    argv = []
    for run, base, steps in cases.values():
        argv += [base, str(run["run_dir"] / f"checkpoint-{steps}"),
                 str(run["probe_dir"] / "logits.pt")]
    python, env = swift_python(swift_bin, {**os.environ, "OMP_NUM_THREADS": "1", **SWIFT_ENV})  # forked
    proc = subprocess.run([python, str(WORKERS / "swift_peft_logits.py"), *argv],
                          check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEFT")]
    assert len(lines) == len(cases), proc.stdout
    return dict(zip(cases, lines, strict=True))


def test_swift_adapter_loads_with_plain_peft(lora_runs, tiny_model, swift_env_peft):
    """The saved adapter is the full [r*E] one: plain PEFT on one process gives the distributed model's logits,
    with this repo's peft/transformers and with the older ones swift runs on."""
    run = lora_runs["mem"]
    adapter = run["run_dir"] / f"checkpoint-{MAX_STEPS}"
    probe = run["logits"]
    logits, base_logits = peft_logits(str(tiny_model), str(adapter), probe["input_ids"])
    assert (base_logits - probe["logits"]).abs().max() > 0.1, "the trained adapter changes nothing"
    assert torch.allclose(logits, probe["logits"], atol=1e-4), (logits - probe["logits"]).abs().max()
    kind, version, diff = swift_env_peft["lora"].split()
    assert kind == "PEFT" and version.startswith("0.2") and float(diff) <= 1e-4, swift_env_peft["lora"]


@pytest.fixture(scope="module")
def two_node_run(swift_bin, tiny_model, tmp_path_factory) -> dict:
    return run_swift_sft(swift_bin, tiny_model, tmp_path_factory.mktemp("swift_2x2"),
                         ["--per_device_train_batch_size", "1", *LORA_ARGS],
                         {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "true"}, nnodes=2)


def test_swift_sft_two_nodes_node_local_sources(two_node_run, tiny_model):
    """2 simulated nodes x 2 ranks (one `swift sft` per node, NNODES/NODE_RANK as on a cluster): each node's
    local rank 0 reads the checkpoint and feeds only its own node; EP groups never span nodes."""
    run = two_node_run
    assert "world_size=4, nodes=2" in run["log"]
    ranks = run["ranks"]
    assert [ranks[r]["loaded_checkpoint"] for r in range(4)] == [True, False, True, False]
    for source, receiver in ((0, 1), (2, 3)):
        sent, got = ranks[source]["init_report"], ranks[receiver]["init_report"]
        assert sent["bytes_received"] == 0 and sent["bytes_sent"] == got["bytes_received"] > 0
        assert got["bytes_received"] == got["shard_bytes"] + got["buffer_bytes"]
    assert sorted(run["losses"]) == list(range(1, MAX_STEPS + 1))
    losses = [run["losses"][s] for s in range(1, MAX_STEPS + 1)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    checkpoint = run["run_dir"] / f"checkpoint-{MAX_STEPS}"
    assert sorted(p.name for p in (checkpoint / "trainer_state" / "rng").iterdir()) == [f"rank{r}.pt" for r in range(4)]
    logits, _ = peft_logits(str(tiny_model), str(checkpoint), run["logits"]["input_ids"])
    assert torch.allclose(logits, run["logits"]["logits"], atol=1e-4), (logits - run["logits"]["logits"]).abs().max()


def test_swift_sft_resumes_on_another_layout(two_node_run, swift_bin, tiny_model, tmp_path):
    """Saved by 2 nodes x 2 ranks with ep_size=2, resumed by 1 node x 4 ranks with ep_size=4 (the same global
    batch): the library's layout-independent trainer_state/, as twinkle-sft resumes."""
    checkpoint = two_node_run["run_dir"] / "checkpoint-5"
    resumed = run_swift_sft(swift_bin, tiny_model, tmp_path, ["--per_device_train_batch_size", "1", *LORA_ARGS,
                                                              "--resume_from_checkpoint", str(checkpoint)],
                            {"TWINKLE_EP_SIZE": "4", "TWINKLE_MEMORY_EFFICIENT_INIT": "true", "NPROC_PER_NODE": "4"})
    assert "world_size=4, nodes=1" in resumed["log"]
    assert sorted(resumed["losses"]) == list(range(6, MAX_STEPS + 1)), resumed["losses"]
    for step, loss in resumed["losses"].items():
        assert abs(loss - two_node_run["losses"][step]) <= 1e-5, (step, resumed["losses"], two_node_run["losses"])
        assert abs(resumed["grad_norms"][step] - two_node_run["grad_norms"][step]) <= 1e-5, step


def test_swift_sft_bad_checkpoint_fails_on_every_rank(swift_bin, tiny_model, tmp_path):
    """A wrong-shaped tensor that only the source reads (memory_efficient_init): the receiver, which never opened
    the file, must not wait forever: both ranks exit with the tensor's name, and no checkpoint is written."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad_model"
    shutil.copytree(tiny_model, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.1.mlp.gate.weight"] = torch.zeros(3, 3)
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    returncodes, log, _ = launch_swift_sft(swift_bin, bad, tmp_path, [*BATCH_2, *LORA_ARGS],
                                           {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"},
                                           timeout=240)
    assert returncodes[0] not in (0, None), returncodes
    # One line for the node (distributed.fatal_errors), not each rank's traceback; every rank's is in its file.
    said = [line for line in log.splitlines() if line.startswith("twinkle_strategy: ")]
    assert len(said) == 1 and "[rank" not in log, _tail(log)
    found = re.fullmatch(r"twinkle_strategy: every rank stopped: DistributedInitError: .*model\.layers\.1\.mlp\.gate"
                         r"\.weight.* \(tracebacks: (.*)\)", said[0])
    assert found, said
    # The source raised it. The receiver raises it too, unless torchrun stopped it first, once the source had
    # exited (as test_launch_errors.py allows): then it wrote no traceback file, and the source's line stands.
    assert "DistributedInitError" in Path(found.group(1).replace("<R>", "0")).read_text()
    receiver = Path(found.group(1).replace("<R>", "1"))
    assert not receiver.exists() or "DistributedInitError" in receiver.read_text()
    assert not glob.glob(str(tmp_path / "output" / "v0-*" / "checkpoint-*"))


def test_swift_sft_deepspeed_is_refused_by_the_plugin_while_swift_parses_its_arguments(parse_refusals):
    """`swift sft --deepspeed zero3`: swift reads --deepspeed (and requires the deepspeed package) before the hook
    that reads the plugin's options; the plugin refuses it first, in one line, while swift is still parsing its
    arguments (one process: nothing is launched, no model is loaded)."""
    log = parse_refusals["outputs"]["deepspeed"]
    assert log.rstrip().endswith("=== exit deepspeed 1"), _tail(log)
    (line,) = [line for line in log.splitlines()
               if line.startswith("twinkle_strategy.integrations.swift.errors.SwiftPluginError")]
    assert line.endswith("SwiftPluginError: --deepspeed zero3 and the twinkle plugin both shard the model: drop "
                         "--deepspeed (the plugin applies FSDP2 and EP itself; its options are TWINKLE_* variables "
                         'or the --fsdp JSON\'s "twinkle" object)'), line
    assert "_init_deepspeed" in log and "require_version" not in log  # before swift's own handling of --deepspeed


# ------------------------------------------------------------- image-text SFT of vision-language MoE models
VL_STEPS = 4
# family -> (swift template, --freeze_vit). Qwen3-VL-MoE as examples/swift_vl_sft.sh runs it (vision tower
# frozen); Qwen3.5-MoE as released (vision tower included) with the vision tower trained too.
VL_CASES = {"qwen3_vl_moe": ("qwen3_vl", True), "qwen3_5_moe_vl": ("qwen3_5", False)}
# all-linear: swift picks the linear layers, honouring --freeze_vit (the vision tower's only when false).
# Learning rate 1e-3: at 5e-3 the tiny Qwen3.5's gradient norm after two steps is only good to ~2e-5 in fp32
# (measured against fp64: 1.6e-5, mostly its linear attention's in_proj_qkv), below the 1e-5 asked here;
# plain swift on 2 processes (DDP) then differs from plain swift on one by 4.9e-5 as well.
VL_LORA_ARGS = ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0",
                "--target_modules", "all-linear",
                "--target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                "--max_steps", str(VL_STEPS), "--save_steps", str(VL_STEPS), "--learning_rate", "1e-3"]
BUILD_VL = """import sys
from twinkle_strategy.testing.tiny_vision import prepare_vl_demo_model, write_vl_demo_dataset
root, families = sys.argv[1], sys.argv[2:]
data = write_vl_demo_dataset(root + "/data")
for family in families:
    prepare_vl_demo_model(f"{root}/{family}", data, family=family)
print(data)
"""
SWIFT_FLAGS = """
import dataclasses, json, swift
from swift.arguments import SftArguments
print(json.dumps([swift.__version__, sorted(f.name for f in dataclasses.fields(SftArguments))]))
"""


@pytest.fixture(scope="module")
def vl_checkpoints(swift_bin, tmp_path_factory) -> dict:
    """The generated image-text data, and a tiny checkpoint of each family saved from its vision-language
    class with its processor; built once, by the transformers swift loads them with. The same process reads the
    installed ms-swift's version and SftArguments fields ("swift_flags": one start-up for both)."""
    root = tmp_path_factory.mktemp("swift_vl")
    python, env = swift_python(swift_bin, {**os.environ, "OMP_NUM_THREADS": "1", **SWIFT_ENV})  # forked
    proc = subprocess.run([python, "-c", BUILD_VL + SWIFT_FLAGS, str(root), *VL_CASES], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    return {"dataset": Path(lines[-2].strip()), "swift_flags": json.loads(lines[-1]),
            **{family: root / family for family in VL_CASES}}


@pytest.fixture(scope="module")
def vl_all_runs(swift_bin, vl_checkpoints, tmp_path_factory) -> dict[str, dict]:
    """Image-text LoRA SFT of each family: the plugin's 2-process EP=2 run with memory_efficient_init, and the
    oracle, plain `swift sft` in one process with the same 4 samples per step."""
    runs = {}
    for family in sorted(VL_CASES):
        template, freeze_vit = VL_CASES[family]
        args = [*VL_LORA_ARGS, "--freeze_vit", str(freeze_vit).lower()]
        data = {"dataset": vl_checkpoints["dataset"], "template": template}
        out = tmp_path_factory.mktemp(f"swift_vl_{family}")
        (out / "mem").mkdir()
        (out / "ref").mkdir()
        mem = run_swift_sft(swift_bin, vl_checkpoints[family], out / "mem", [*BATCH_2, *args],
                            {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"}, **data)
        ref = run_swift_sft(swift_bin, vl_checkpoints[family], out / "ref",
                            ["--per_device_train_batch_size", "4", *args], {}, reference=True, **data)
        runs[family] = {"family": family, "freeze_vit": freeze_vit, "model": vl_checkpoints[family], "mem": mem,
                        "ref": ref}
    return runs


@pytest.fixture(params=sorted(VL_CASES))
def vl_runs(request, vl_all_runs) -> dict:
    """One family's runs (vl_all_runs)."""
    return vl_all_runs[request.param]


def test_swift_vl_sft_matches_single_process(vl_runs):
    """Images really go through the model (vision tokens expanded by swift's template from the processor's
    image grid), and the plugin's EP=2 run logs the loss and gradient norm of plain single-process swift at
    every step, ending with the same logits on an image-text batch."""
    mem, ref = vl_runs["mem"], vl_runs["ref"]
    assert "memory_efficient_init=True" in mem["log"] and "twinkle swift plugin" not in ref["log"]
    assert mem["ranks"][1]["loaded_checkpoint"] is False and mem["ranks"][0]["loaded_checkpoint"] is True
    report = mem["ranks"][1]["init_report"]
    assert report["bytes_received"] == report["shard_bytes"] + report["buffer_bytes"] > 0
    batch = mem["logits"]["image_text"]["inputs"]
    image_token_id = json.loads((vl_runs["model"] / "config.json").read_text())["image_token_id"]
    merged_patches = int(batch["image_grid_thw"].prod(dim=-1).sum()) // 4  # spatial_merge_size 2
    assert int((batch["input_ids"] == image_token_id).sum()) == merged_patches > 0
    assert batch["pixel_values"].shape[0] == 4 * merged_patches
    for key, tensor in ref["logits"]["image_text"]["inputs"].items():
        assert torch.equal(batch[key], tensor), key
    assert sorted(ref["losses"]) == sorted(mem["losses"]) == list(range(1, VL_STEPS + 1))
    assert_same_steps(mem, ref, atol=1e-5)
    assert mem["losses"][VL_STEPS] < mem["losses"][1], mem["losses"]
    diff = (mem["logits"]["image_text"]["logits"] - ref["logits"]["image_text"]["logits"]).abs().max()
    assert diff <= 1e-4, diff


def test_swift_vl_adapter_loads_with_plain_peft(vl_runs, swift_env_peft):
    """The saved adapter, loaded by plain PEFT onto the vision-language class on one process, gives the
    distributed model's logits on the image-text batch, with swift's peft/transformers and with this repo's."""
    from workers.swift_peft_logits import peft_image_text_logits

    run = vl_runs["mem"]
    adapter = run["run_dir"] / f"checkpoint-{VL_STEPS}"
    probe = run["logits"]["image_text"]
    logits, base_logits = peft_image_text_logits(str(vl_runs["model"]), str(adapter), probe["inputs"])
    assert (base_logits - probe["logits"]).abs().max() > 0.1, "the trained adapter changes nothing"
    assert torch.allclose(logits, probe["logits"], atol=1e-4), (logits - probe["logits"]).abs().max()
    line = swift_env_peft[vl_runs["family"]]
    kind, version, diff = line.split()
    assert kind == "PEFT-IMAGE-TEXT" and version.startswith("0.2") and float(diff) <= 1e-4, line


def test_swift_vl_freeze_vit_decides_whether_the_vision_tower_trains(vl_runs):
    """--freeze_vit true: no adapter on the vision tower. --freeze_vit false: LoRA on the vision tower's
    linear layers, trained (lora_B starts at zero, so non-zero means it got gradients and was updated), equal
    to the single-process run's; the aligner stays frozen (swift's --freeze_aligner true)."""
    from safetensors.torch import load_file

    saved, expected = (load_file(str(vl_runs[r]["run_dir"] / f"checkpoint-{VL_STEPS}" / "adapter_model.safetensors"))
                       for r in ("mem", "ref"))
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(saved[name], tensor, atol=1e-5), (name, (saved[name] - tensor).abs().max())
    assert any("experts" in name for name in saved) and any("self_attn" in name for name in saved)
    vision = [name for name in saved if ".visual." in name]
    assert not [name for name in vision if ".merger." in name]
    if vl_runs["freeze_vit"]:
        assert not vision, vision
    else:
        vision_b = [name for name in vision if ".blocks." in name and "lora_B" in name]
        assert vision_b, sorted(saved)
        for name in vision_b:
            assert saved[name].abs().max() > 0, f"{name} did not train"


def test_twinkle_sft_knows_every_flag_of_the_installed_swift_sft(vl_checkpoints):
    """twinkle_strategy/train/swift_flags.py lists the fields of ms-swift's SftArguments, each taken by twinkle-sft
    or refused with its reason (tests/unit/test_launch_error_lines.py checks which): this fails when the pinned ms-swift
    adds, renames or drops a flag, so that the list and its reasons are brought up to date. (The fields come from
    the swift process that built the vision-language checkpoints: vl_checkpoints.)"""
    from twinkle_strategy.train.swift_flags import SWIFT_SFT_FLAGS, SWIFT_VERSION

    version, fields = vl_checkpoints["swift_flags"]
    assert version == SWIFT_VERSION
    assert sorted(SWIFT_SFT_FLAGS) == fields, (sorted(set(fields) - set(SWIFT_SFT_FLAGS)),
                                               sorted(set(SWIFT_SFT_FLAGS) - set(fields)))


# ------------------------------------------------------------- options and argument checks (no swift needed)
def test_plugin_options_from_environment_and_fsdp_json():
    from twinkle_strategy.integrations.swift.plugin import SwiftPluginError, resolve_options

    env = {"TWINKLE_EP_SIZE": "4", "TWINKLE_MEMORY_EFFICIENT_INIT": "0", "TWINKLE_INIT_BUCKET_MB": "64"}
    assert resolve_options(None, env) == {"ep_size": 4, "memory_efficient_init": False, "init_bucket_mb": 64.0}
    # the --fsdp JSON wins over the environment
    assert resolve_options({"ep_size": 8, "verify_init": True}, env)["ep_size"] == 8
    assert resolve_options({}, {}) == {"memory_efficient_init": True}  # the rest: StrategyConfig's defaults
    with pytest.raises(SwiftPluginError, match="TWINKLE_EP_SIZE='two'"):
        resolve_options(None, {"TWINKLE_EP_SIZE": "two"})
    with pytest.raises(SwiftPluginError, match=r"unknown key\(s\) \['ep'\]"):
        resolve_options({"ep": 2}, {})
    with pytest.raises(SwiftPluginError, match="expected true/false"):
        resolve_options({"memory_efficient_init": "maybe"}, {})


def test_plugin_reads_async_save_as_a_trainer_option_before_any_weight_loads():
    # resolve_options runs in swift's argument parsing, before any model is loaded (parts/arguments.py).
    from twinkle_strategy.integrations.swift.parts.options import trainer_options
    from twinkle_strategy.integrations.swift.plugin import SwiftPluginError, resolve_options

    assert trainer_options(None, {"TWINKLE_ASYNC_SAVE": "1"}) == {"async_save": True}
    assert trainer_options({"async_save": False}, {"TWINKLE_ASYNC_SAVE": "1"}) == {"async_save": False}  # JSON wins
    assert trainer_options(None, {}) == {"async_save": False}
    # not a strategy option: the strategy is built without it
    assert resolve_options({"async_save": True}, {"TWINKLE_ASYNC_SAVE": "1"}) == {"memory_efficient_init": True}
    with pytest.raises(SwiftPluginError, match=r"^environment variable TWINKLE_ASYNC_SAVE='soon': expected true/false"):
        resolve_options(None, {"TWINKLE_ASYNC_SAVE": "soon"})


def test_plugin_reads_the_fit_checks_options_apart_from_the_strategys():
    from twinkle_strategy.integrations.swift.parts.fit import launched_world, plan_options
    from twinkle_strategy.integrations.swift.plugin import SwiftPluginError, resolve_options

    assert plan_options(None, {}) == {"device_memory": None, "skip_plan": False, "routing_skew": 1.0}
    env = {"TWINKLE_DEVICE_MEMORY": "80GiB", "TWINKLE_ROUTING_SKEW": "1.5"}
    assert plan_options(None, env) == {"device_memory": 80 * 2**30, "skip_plan": False, "routing_skew": 1.5}
    assert plan_options({"device_memory": "141G", "skip_plan": True}, env)["device_memory"] == 141 * 10**9  # JSON wins
    assert resolve_options({"device_memory": "80GiB", "skip_plan": True}, env) == {"memory_efficient_init": True}
    with pytest.raises(SwiftPluginError, match=r"^environment variable TWINKLE_DEVICE_MEMORY='lots': "):
        plan_options(None, {"TWINKLE_DEVICE_MEMORY": "lots"})
    assert launched_world({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == (2, 4)
    assert launched_world({}) == (1, 1)


def test_plugin_rejects_lora_options_the_expert_path_cannot_serve():
    from twinkle_strategy.integrations.swift.plugin import SwiftPluginError, check_arguments

    args = types.SimpleNamespace(tuner_type="lora", lora_dropout=0.05, use_dora=False, lora_bias="none",
                                 target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(SwiftPluginError, match="--lora_dropout 0"):
        check_arguments(args)
    args.lora_dropout = 0.0
    check_arguments(args)
    args.tuner_type = "adalora"
    with pytest.raises(SwiftPluginError, match="--tuner_type adalora"):
        check_arguments(args)


def test_plugin_takes_sequence_parallel_from_swift_and_refuses_what_a_chunk_cannot_serve():
    """``SftArguments._init_fsdp``'s hook, before the model loads: --sequence_parallel_size becomes the strategy's and
    swift's own goes back to 1 (logits_to_keep off); an option that computes a chunk's loss on its own terms is
    refused with its flag; the plugin option is the same setting."""
    from twinkle_strategy.integrations.swift.parts.sequence import take_sequence_parallel
    from twinkle_strategy.integrations.swift.plugin import SwiftPluginError

    def args(**changes):
        return types.SimpleNamespace(**{"sequence_parallel_size": 2, "loss_type": None, "label_smoothing_factor": 0.0,
                                        "enable_dft_loss": False, "enable_channel_loss": False,
                                        "router_aux_loss_coef": 0.0, "use_logits_to_keep": None, "acc_strategy": "token",
                                        "padding_side": "right", "val_dataset": [], "split_dataset_ratio": 0.0,
                                        "eval_strategy": "steps", **changes})

    taken = args()
    assert take_sequence_parallel(taken) == 2
    assert (taken.sequence_parallel_size, taken.use_logits_to_keep) == (1, False)
    assert take_sequence_parallel(args(sequence_parallel_size=1)) == 1
    assert take_sequence_parallel(args(sequence_parallel_size=1), option=4) == 4  # TWINKLE_SEQUENCE_PARALLEL_SIZE
    with pytest.raises(SwiftPluginError, match=r"^--sequence_parallel_size 2 and the plugin option "
                                               r"sequence_parallel_size=4 disagree"):
        take_sequence_parallel(args(), option=4)
    for change, flag in (({"loss_type": "dft"}, "--loss_type dft"), ({"label_smoothing_factor": 0.1},
                                                                      "--label_smoothing_factor"),
                         ({"router_aux_loss_coef": 0.01}, "--router_aux_loss_coef 0.01"),
                         ({"use_logits_to_keep": True}, "--use_logits_to_keep true"),
                         ({"acc_strategy": "seq"}, "--acc_strategy seq"), ({"padding_side": "left"}, "--padding_side left"),
                         ({"split_dataset_ratio": 0.1}, r"evaluation \(--val_dataset or --split_dataset_ratio\)"),
                         ({"enable_dft_loss": True}, "--enable_dft_loss true")):
        with pytest.raises(SwiftPluginError, match=f"^--sequence_parallel_size 2 with {flag}: .*, or "
                                                   "--sequence_parallel_size 1$"):
            take_sequence_parallel(args(**change))


def test_plugin_names_swifts_launch_setting_where_the_library_names_torchrun():
    """Issue 36: the library's error names torchrun (every launcher wraps it) and the Python option; the plugin adds
    swift's own setting. One process (no torchrun, as swift sft runs on one device) with ep_size 2."""
    code = ("from twinkle_strategy.errors import ParallelConfigError\n"
            "from twinkle_strategy.integrations.swift.parts import state\n"
            "state.STATE.fsdp_options = {'ep_size': 2, 'device_type': 'cpu'}\n"
            "try:\n    state.get_strategy()\nexcept ParallelConfigError as exc:\n    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    python, env = forked_python(sys.executable, {**env, "OMP_NUM_THREADS": "1"})  # forked from its preload server
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("ep_size 2 needs 2 processes (or a multiple), this job has 1: launch them, e.g. "
                                   "torchrun --nproc_per_node 2 your_script.py (so that nodes x processes per node is "
                                   "a multiple of 2); with swift sft: NPROC_PER_NODE (and NNODES)"), proc.stdout


def test_plugin_module_imports_without_swift():
    """Outside ms-swift (e.g. for `twinkle-sft --swift-plugin-path`) importing it hooks nothing: this process (.venv,
    no ms-swift) imports it."""
    import importlib.util

    import twinkle_strategy.integrations.swift.plugin as plugin

    assert importlib.util.find_spec("swift") is None  # .venv has no ms-swift: nothing to hook
    assert plugin.plugin_path() == str(PLUGIN)
    # the installed console script, as the docs use it: PLUGIN=$(twinkle-sft --swift-plugin-path)
    cli = Path(sys.executable).parent / "twinkle-sft"
    proc = subprocess.run([str(cli), "--swift-plugin-path"], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(PLUGIN)
