"""twinkle-sft's recipe parsing, run directories and train state, in this process (the launches are
tests/multiproc/test_trainer_cli.py's)."""

import json
from pathlib import Path

import pytest
import torch
from multinode import REPO

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")


@pytest.mark.parametrize("override,message", [
    ("strategy.memory_efficent_init=true", "unknown recipe key 'strategy.memory_efficent_init' in "
                                           "strategy.memory_efficent_init=true; did you mean "
                                           "strategy.memory_efficient_init?"),
    ("train.max_steps=ten", "train.max_steps"),
    ("strategy.ep_size=3", "strategy.ep_size (--expert_parallel_size): tiny://demo has 8 experts, not divisible "
                           "by ep_size 3; choose ep_size among [1, 2, 4]"),
    ("tuner.type=full train.merge_lora=true", "train.merge_lora (--merge_lora): true needs tuner.type=lora (got "
                                              "'full')"),
    ("--optim sgd", "train.optim (--optim): 'sgd' is not an AdamW implementation twinkle-sft has; use one of "
                    "adamw_torch_fused, adamw_torch"),
    ("train.optim=adamw_hf", "train.optim (--optim): 'adamw_hf' is not"),
    ("--reduce_dtype int8", "strategy.reduce_dtype (--reduce_dtype): reduce_dtype='int8' is not valid: use a float "
                            "dtype: float32 (the default), bfloat16 or float16"),
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
