"""Trainer, YAML recipes and the twinkle-sft CLI, end to end on simulated nodes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multinode import REPO, launch

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
STEPS = 8


def run_cli(args, cwd, timeout=600):
    # No MASTER_PORT: a one-node twinkle-sft picks a free one itself, and picks again if another run takes it.
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "twinkle_strategy.train.cli", *args], cwd=cwd, env=env,
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
    planned = run_cli(["plan", *recipe, "--json"], cwd=work)
    assert planned.returncode == 0, planned.stderr[-3000:]
    peak = json.loads(planned.stdout)["step_peak_bytes"]
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


@pytest.mark.parametrize("override,message", [
    ("strategy.memory_efficent_init=true", "unknown recipe key 'strategy.memory_efficent_init' in "
                                           "strategy.memory_efficent_init=true; did you mean "
                                           "strategy.memory_efficient_init?"),
    ("train.max_steps=ten", "train.max_steps"),
    ("strategy.ep_size=3", "strategy.ep_size (--expert_parallel_size): tiny://demo has 8 experts, not divisible "
                           "by ep_size 3; choose ep_size among [1, 2, 4]"),
    ("tuner.type=full train.merge_lora=true", "train.merge_lora (--merge_lora): true needs tuner.type=lora (got "
                                              "'full')"),
])
def test_bad_recipe_fails_before_launch(override, message, tmp_path, capsys):
    import torch.distributed as dist

    from twinkle_strategy.train.cli import main

    out = tmp_path / "out"
    code = main([str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", f"train.output_dir={out}",
                 *override.split()])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not out.exists() and not dist.is_initialized()


def test_swift_style_flags_map_to_recipe_keys():
    from twinkle_strategy.train.cli import build_parser, parse

    recipe = parse(["--model", "/m", "--dataset", "d.jsonl", "--train_type", "full", "--lora_rank", "4",
                    "--target_modules", "q_proj", "v_proj", "--expert_parallel_size", "1",
                    "--memory_efficient_init", "true", "--num_train_epochs", "2", "--learning_rate", "1e-5",
                    "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
                    "--output_dir", "o", "--max_steps", "7", "--resume_from_checkpoint", "ck"])
    assert (recipe.model.path, recipe.data.dataset, recipe.tuner.type, recipe.tuner.lora_rank) == \
        ("/m", ["d.jsonl"], "full", 4)
    assert recipe.tuner.target_modules == ["q_proj", "v_proj"] and recipe.strategy.memory_efficient_init is True
    assert (recipe.train.num_train_epochs, recipe.train.learning_rate, recipe.train.per_device_train_batch_size,
            recipe.train.gradient_accumulation_steps, recipe.train.output_dir, recipe.train.max_steps,
            recipe.train.resume_from_checkpoint) == (2.0, 1e-5, 3, 2, "o", 7, "ck")
    help_text = build_parser().format_help()
    for flag in ("--model", "--dataset", "--tuner_type", "--train_type", "--lora_rank", "--lora_alpha",
                 "--target_modules", "--target_parameters", "--expert_parallel_size", "--memory_efficient_init",
                 "--output_dir", "--num_train_epochs", "--max_steps", "--learning_rate",
                 "--per_device_train_batch_size", "--gradient_accumulation_steps", "--resume_from_checkpoint"):
        assert flag in help_text


def test_run_directories_are_versioned_and_a_restart_continues_the_newest(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from twinkle_strategy.train.arguments import TrainingArguments
    from twinkle_strategy.train.run_dir import make_run_dir, newest_run_dir, open_run_dir

    out = tmp_path / "out"
    assert make_run_dir(str(out), add_version=False) == str(out) and newest_run_dir(str(out)) is None
    assert Path(make_run_dir(str(out), add_version=True)).name.startswith("v0-")
    for name in ("v0-20260101-000000", "v9-20260101-000000", "notes"):
        (out / name).mkdir(parents=True)
    assert Path(make_run_dir(str(out), add_version=True)).name.startswith("v10-")
    assert newest_run_dir(str(out)) == str(out / "v9-20260101-000000")
    one_process = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, world_size=1, ep_size=1,
                                  memory_efficient_init=False)
    args = TrainingArguments(output_dir=str(out))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the workers: the same run goes on
    run = open_run_dir(args, one_process)
    assert run.restarted and run.path == str(out / "v9-20260101-000000")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    run = open_run_dir(args, one_process)
    assert not run.restarted and Path(run.path).name.startswith("v10-")
    written = json.loads((Path(run.path) / "args.json").read_text())
    assert written["training_args"]["output_dir"] == str(out) and written["world_size"] == 1


def test_train_state_keeps_steps_as_integers_through_a_checkpoint():
    from twinkle_strategy.train.state import TrainState

    state = TrainState(max_steps=6, steps_per_epoch=4, global_batch=8)
    for step in (1, 2):
        state.global_step = step
        state.log(step, {"loss": 1.0 / step, "global_step/max_steps": f"{step}/6"})
    saved = json.loads(json.dumps(state.saved_at(2)))  # as trainer_state.json holds it
    resumed = TrainState(max_steps=6, steps_per_epoch=4, global_batch=8)
    resumed.resume(saved)
    assert (resumed.start_step, resumed.global_step, resumed.epoch, resumed.logged_steps) == (2, 2, 0.5, [1, 2])
    assert resumed.log_history == state.log_history
    older = TrainState(max_steps=6, steps_per_epoch=4, global_batch=8)
    older.resume({k: v for k, v in saved.items() if k != "log_steps"})  # saved before log_steps existed
    assert older.logged_steps == [1, 2]


@pytest.mark.parametrize("recipe", sorted((REPO / "yaml").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_are_valid(recipe):
    from twinkle_strategy.train.recipe import load_recipe

    loaded = load_recipe(str(recipe))
    assert loaded.launch.nnodes * loaded.launch.nproc_per_node % loaded.strategy.ep_size == 0
    assert loaded.model.path and loaded.data.dataset


def test_swift_style_relaunch_under_torchrun(demo_run, tmp_path):
    """NPROC_PER_NODE=2, like swift: twinkle-sft re-launches itself under torchrun (one node, 2 ranks)."""
    work, _, _, _ = demo_run
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1",
           "NPROC_PER_NODE": "2"}  # no MASTER_PORT: twinkle-sft picks one
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "twinkle_strategy.train.cli", "--model", str(work / "output" / "tiny" / "demo"),
                           "--dataset", DATASET, "--tuner_type", "lora", "--target_modules", "q_proj",
                           "--expert_parallel_size", "2", "--memory_efficient_init", "true", "--torch_dtype", "float32",
                           "--mixed_precision", "no", "--max_steps", "3", "--logging_steps", "1",
                           "--per_device_train_batch_size", "2", "--output_dir", str(out)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(out)
    assert len(read_log(run_dir)) == 3
    assert json.loads((run_dir / "args.json").read_text())["world_size"] == 2
    assert (run_dir / "checkpoint-3" / "adapter_model.safetensors").is_file()


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
