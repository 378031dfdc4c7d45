"""Trainer, YAML recipes and the twinkle-sft CLI, end to end on simulated nodes."""

import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from multinode import REPO, launch
from preload import cli_command, cli_env

from twinkle_strategy.train.cli import main

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
STEPS = 8


def run_cli(args, cwd, timeout=600):
    # No MASTER_PORT: a one-node twinkle-sft picks a free one itself, and picks again if another run takes it.
    env = cli_env({**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1"})
    return subprocess.run([*cli_command(env), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_log(run_dir):
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


def only_run_dir(output_dir):
    runs = sorted(p for p in Path(output_dir).iterdir() if p.name.startswith("v"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo recipe, shortened, through the CLI (2 simulated nodes x 2 ranks, ep=2, mem-efficient init, LoRA)."""
    work = tmp_path_factory.mktemp("demo")
    out = work / "out"
    recipe = [str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", f"train.output_dir={out}",
              f"train.max_steps={STEPS}", "train.save_steps=4", "train.logging_steps=1", "--merge_lora", "true"]
    # The memory plan's peak for this run: the launch below gets a budget just over it (it must train), and
    # tests/multiproc/test_fit_check.py one just under (it must be refused before any process starts).
    # In this process: the plan starts no rank (a launch of its own cost as much as the plan).
    stdout = io.StringIO()
    with contextlib.chdir(work), contextlib.redirect_stdout(stdout):
        assert main(["plan", *recipe, "--json"]) == 0
    peak = json.loads(stdout.getvalue())["step_peak_bytes"]
    proc = run_cli([*recipe, "--device_memory", str(int(peak * 1.01))], cwd=work)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return work, only_run_dir(out), proc, peak


def test_demo_cli_trains_and_saves(demo_run):
    work, run_dir, proc, planned_peak = demo_run
    log = read_log(run_dir)
    assert [e["global_step/max_steps"] for e in log] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)]
    losses = [e["loss"] for e in log]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    for key in ("grad_norm", "learning_rate", "epoch", "elapsed_time", "remaining_time", "memory(GiB)",
                "train_speed(s/it)"):
        assert key in log[0]
    # Launched with a budget just over the plan's peak: it trained, and the step log shows the plan beside the
    # measured peak.
    assert {e["planned_memory(GiB)"] for e in log} == {round(planned_peak / 2**30, 6)}
    assert (run_dir / "args.json").is_file() and (run_dir / "images" / "train_loss.png").is_file()
    for step in (4, STEPS):
        ckpt = run_dir / f"checkpoint-{step}"
        assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
        state = ckpt / "trainer_state"
        assert (ckpt / "trainer_state.json").is_file()
        # Resume state by full tensor (any layout can read it), scheduler, one RNG file per rank.
        for name in ("optimizer.json", "trainable.safetensors", "scheduler.pt"):
            assert (state / name).is_file(), name
        assert list(state.glob("optimizer*.safetensors"))
        assert sorted(p.name for p in (state / "rng").iterdir()) == [f"rank{r}.pt" for r in range(4)]
    assert not list(run_dir.glob("*.tmp"))
    assert "memory_efficient_init:" in proc.stderr and "(source)" in proc.stderr  # the init log line
    # The final metrics dict and the bars' 100% once appeared twice. Rank 0's output, which the terminal shows,
    # as a terminal shows it: a bar redrawn in place with '\r' is one line, what overwrites it last stays.
    # (Read from its log in bytes: proc.stderr came through text mode, which turned each '\r' into a newline.)
    raw = (run_dir / "logs" / "rank0.log").read_bytes().decode()
    shown = [[piece for piece in line.split("\r") if piece.strip()][-1] for line in raw.split("\n") if line.strip()]
    assert sum(f"'global_step/max_steps': '{STEPS}/{STEPS}'" in line for line in shown) == 1, shown
    assert sum(line.startswith("Train: 100%") for line in shown) == 1, shown
    assert sum(line.startswith("memory_efficient_init: reading and sending shards: 100%") for line in shown) == 1
    assert len(shown) == len(set(shown)), [line for line in shown if shown.count(line) > 1]
    assert f"last checkpoint: {run_dir.relative_to(work) / f'checkpoint-{STEPS}'}" in proc.stdout or \
        f"checkpoint-{STEPS}" in proc.stdout


START_PARTS = ["plan", "launch", "imports", "init", "data", "first step"]


def test_the_start_line_tells_the_time_to_the_first_step_and_its_parts(demo_run):
    """Issue 45: rank 0 tells, in one line after the first step, the seconds from twinkle-sft's start to the first
    step's end and their parts, which add up; the first step's log entry holds the same. The launch ran the fit
    check (its budget was given): the plan is one of the parts (a fraction of a second here: the plan command
    above kept the same plan)."""
    work, run_dir, proc, _ = demo_run
    lines = [line for line in (run_dir / "logs" / "rank0.log").read_text().splitlines() if line.startswith("start:")]
    assert len(lines) == 1 and lines[0] in proc.stderr, lines
    said = re.fullmatch(r"start: (-?[\d.]+) s to the first step \((.*)\)", lines[0])
    assert said, lines[0]
    parts = {name: float(value) for name, value in
             (re.fullmatch(r"(.+) (-?[\d.]+) s", part).groups() for part in said.group(2).split(", "))}
    total = float(said.group(1))
    assert list(parts) == START_PARTS and all(seconds >= 0 for seconds in parts.values()), lines[0]
    assert abs(sum(parts.values()) - total) <= 0.05 * (len(parts) + 1), lines[0]  # each rounded to 0.1 s
    assert parts["init"] > 0 and parts["first step"] > 0 and total > parts["first step"], lines[0]
    log = read_log(run_dir)
    logged = {name.replace("_", " "): seconds for name, seconds in log[0]["start_parts(s)"].items()}
    assert list(logged) == START_PARTS and abs(log[0]["start(s)"] - total) <= 0.05, (log[0], lines[0])
    assert all(abs(logged[name] - parts[name]) <= 0.05 for name in START_PARTS), (logged, parts)
    assert not any("start(s)" in entry for entry in log[1:])


def test_merge_lora_writes_the_merged_model_beside_the_last_checkpoint(demo_run):
    """--merge_lora true (swift export's flag): after the last step, checkpoint-{N}-merged is a plain checkpoint of
    the base with the adapters merged. Oracle, in one process: the base with the saved adapter through PEFT
    (unmerged, the adapter applied to activations) gives the merged model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work, run_dir, proc, _ = demo_run
    merged_dir = run_dir / f"checkpoint-{STEPS}-merged"
    assert f"merged model: {merged_dir}" in proc.stdout, proc.stdout[-2000:]
    assert list(merged_dir.glob("model*.safetensors")) and not list(merged_dir.glob("adapter_*")), \
        sorted(p.name for p in merged_dir.iterdir())
    base_dir = work / "output" / "tiny" / "demo"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(run_dir / f"checkpoint-{STEPS}")).eval()
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    assert (got - base_logits).abs().max() > 1e-2  # the adapters are in


def test_resume_gives_the_same_losses(demo_run):
    work, run_dir, _, _ = demo_run
    out = work / "resumed"
    proc = run_cli([str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", f"train.output_dir={out}",
                    f"train.max_steps={STEPS}", "train.save_steps=4", "train.logging_steps=1",
                    f"train.resume_from_checkpoint={run_dir / 'checkpoint-4'}"], cwd=work)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    uninterrupted = {e["global_step/max_steps"]: e["loss"] for e in read_log(run_dir)}
    resumed = read_log(only_run_dir(out))
    assert [e["global_step/max_steps"] for e in resumed] == [f"{i}/{STEPS}" for i in range(5, STEPS + 1)]
    for e in resumed:
        assert abs(e["loss"] - uninterrupted[e["global_step/max_steps"]]) <= 1e-6, (e, uninterrupted)


@pytest.fixture(scope="module")
def variant_runs(demo_run):
    """The demo recipe again with --padding_free true, and with --packing true. The padding-free run also takes
    train.gradient_checkpointing=true: each changes nothing but memory, so one launch checks both (a loss off by
    either fails test_activation_checkpointing_logs_the_same_losses and the padding-free test alike)."""
    work = demo_run[0]
    runs = {}
    for flag, extra in (("--padding_free", ["train.gradient_checkpointing=true"]), ("--packing", [])):
        out = work / flag.strip("-")
        proc = run_cli([str(REPO / "yaml" / "demo.yaml"), "--dataset", DATASET, "--output_dir", str(out),
                        "--max_steps", str(STEPS), "--save_steps", "100", "--logging_steps", "1", flag, "true",
                        *extra], cwd=work)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
        runs[flag] = proc, only_run_dir(out)
    return runs


def test_activation_checkpointing_logs_the_same_losses(demo_run, variant_runs):
    """train.gradient_checkpointing=true recomputes each decoder layer (EP dispatch replayed): same losses.
    (Rides the padding-free run of variant_runs.)"""
    _, run_dir, _, _ = demo_run
    proc, checkpointed_dir = variant_runs["--padding_free"]
    assert "train.gradient_checkpointing=true" in proc.args
    plain = {e["global_step/max_steps"]: e["loss"] for e in read_log(run_dir)}
    checkpointed = read_log(checkpointed_dir)
    assert [e["global_step/max_steps"] for e in checkpointed] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)]
    for e in checkpointed:
        assert abs(e["loss"] - plain[e["global_step/max_steps"]]) <= 1e-5, (e, plain)


def test_padding_free_and_packing_through_twinkle_sft(demo_run, variant_runs):
    """--padding_free true: each micro-batch's examples in one row instead of padded rows, each attending only to
    itself, so the demo's steps (the same examples) log the same losses. --packing true: examples packed into
    rows of up to max_length tokens (other steps, so other losses) train as well."""
    _, run_dir, _, _ = demo_run
    padded = {e["global_step/max_steps"]: e["loss"] for e in read_log(run_dir)}
    for flag in ("--padding_free", "--packing"):
        proc, run = variant_runs[flag]
        log = read_log(run)
        assert [e["global_step/max_steps"] for e in log] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)]
        said = {"--padding_free": r"data\.padding_free: each micro-batch's examples concatenated into one row",
                "--packing": r"data\.packing: (\d+) examples in (\d+) packs of up to 64 tokens"}[flag]
        found = re.search(said, proc.stderr)
        assert found, proc.stderr[-3000:]
        if flag == "--packing":
            assert int(found[1]) >= 2 * int(found[2]), found[0]  # two or more examples per pack
        losses = [e["loss"] for e in log]
        if flag == "--padding_free":
            for e in log:
                assert abs(e["loss"] - padded[e["global_step/max_steps"]]) <= 1e-5, (e, padded)
        else:
            assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
        assert all(e["tokens_per_second"] > 0 for e in log)


def test_python_trainer_matches_cli_and_checkpoints_load_on_one_process(demo_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset

    work, run_dir, _, _ = demo_run
    model_path = str(work / "output" / "tiny" / "demo")
    result = launch("trainer_python.py", ["--model", model_path, "--dataset", DATASET, "--output-dir",
                                          str(tmp_path / "py"), "--max-steps", str(STEPS)],
                    tmp_path / "launch", nnodes=2, nproc_per_node=2, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    cli_losses = [e["loss"] for e in read_log(run_dir)]
    assert ranks[0]["losses"] == pytest.approx(cli_losses, abs=1e-6)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = SFTDataset.from_jsonl(DATASET, tokenizer, max_length=64)
    batch = DataCollatorForSFT(tokenizer.pad_token_id)([dataset[i] for i in range(3)])
    # LoRA: the full adapter loads with plain PEFT on one process and reproduces the distributed logits.
    lora_ckpt = os.path.join(ranks[0]["lora_run_dir"], f"checkpoint-{STEPS}")
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora_ckpt)
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for rank in ranks:
        torch.testing.assert_close(logits, torch.tensor(ranks[rank]["lora_logits"]), rtol=0, atol=1e-5)
    # Full parameters: model.safetensors loads with from_pretrained (experts gathered from every EP rank).
    full_ckpt = os.path.join(ranks[0]["full_run_dir"], "checkpoint-2")
    full = AutoModelForCausalLM.from_pretrained(full_ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = full(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, torch.tensor(ranks[0]["full_logits"]), rtol=0, atol=1e-5)

def test_swift_style_relaunch_under_torchrun(swift_style_relaunch):
    """NPROC_PER_NODE=2, like swift: twinkle-sft re-launches itself under torchrun (one node, 2 ranks). (The launch
    of tests/launches.py, whose dataset's bad rows test_launch_errors.py checks: one epoch of 17 rows is 4 steps.)"""
    proc = swift_style_relaunch.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(swift_style_relaunch.output_dir)
    assert len(read_log(run_dir)) == 4
    assert json.loads((run_dir / "args.json").read_text())["world_size"] == 2
    assert (run_dir / "checkpoint-4" / "adapter_model.safetensors").is_file()


def test_twinkle_sft_trains_a_vision_language_checkpoint_on_text(tmp_path):
    """Qwen3.5-MoE as released (its vision-language class, vision tower included): text-only LoRA SFT through
    the demo recipe on 2 simulated nodes x 2 ranks; the adapter loads with plain PEFT onto that class."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from twinkle_strategy.testing.tiny_models import TINY_CONFIGS
    from twinkle_strategy.train.demo_model import prepare_demo_model

    model_dir = prepare_demo_model(str(tmp_path / "qwen3_5_moe_vl"), DATASET,
                                   build_config=TINY_CONFIGS["qwen3_5_moe_vl"])
    out = tmp_path / "out"
    proc = run_cli([str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", f"model.path={model_dir}",
                    f"train.output_dir={out}", "train.max_steps=10", "train.logging_steps=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    run_dir = only_run_dir(out)
    losses = [e["loss"] for e in read_log(run_dir)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(base).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert any(".visual." in name for name, _ in base.named_parameters())
    adapter = PeftModel.from_pretrained(base, str(run_dir / "checkpoint-10"))
    trained = [n for n, p in adapter.named_parameters() if "lora_B" in n and "experts" in n and p.abs().sum() > 0]
    assert trained, "the experts' LoRA did not train"
