"""The checks twinkle-sft makes before launch and the pieces of its failure summary, in this process: each mistake
is one line naming key and flag, status 2, nothing written, no process group (the launches are
tests/multiproc/test_launch_errors.py's)."""

import io
import json
import os
from pathlib import Path

import pytest
from cli_cases import (
    DATASET,
    DEMO,
    FIX_LAUNCHES,
    FIX_SAID,
    MISTAKE_IDS,
    MISTAKES,
    SAME_KIND,
    demo_rows,
    twenty_rows_three_bad,
    write_rows,
)
from multinode import REPO


# ------------------------------------------------------------------------- checks before launch
def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(overrides, the one line expected) for every check made before launch."""
    tmp.mkdir()
    (tmp / "a_dir").mkdir()
    (tmp / "no_config").mkdir()
    (tmp / "no_weights").mkdir()
    (tmp / "no_weights" / "config.json").write_text("{}")
    (tmp / "lost_shard").mkdir()
    (tmp / "lost_shard" / "config.json").write_text("{}")
    (tmp / "lost_shard" / "model-00001-of-00002.safetensors").write_bytes(b"")
    (tmp / "lost_shard" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    wrong_keys = write_rows(tmp / "wrong_keys.jsonl", [{"text": "x"}] * 3)
    bad20 = twenty_rows_three_bad(tmp / "bad20.jsonl")
    return [
        ([f"data.dataset={tmp}/nope.jsonl"],
         f"data.dataset (--dataset): dataset file '{tmp}/nope.jsonl' does not exist"),
        ([f"data.dataset={tmp}/a_dir"], f"data.dataset (--dataset): dataset '{tmp}/a_dir' is a directory"),
        ([f"data.dataset=[{DATASET},{tmp}/binary.jsonl]"],
         f"data.dataset (--dataset): dataset file '{tmp}/binary.jsonl' has no usable row"),
        ([f"data.dataset={wrong_keys}"], "has no usable row: all 3 rows were skipped, e.g. "
                                         f"{wrong_keys}:1: a row needs 'messages', or 'query' and 'response'"),
        ([f"data.dataset={DATASET}#many"], "after '#' comes the number of examples to use"),
        ([f"data.dataset={bad20}", "data.strict=true"], f"{bad20}:4: not valid JSON"),
        ([f"model.path={tmp}/nope"], f"model.path (--model): '{tmp}/nope' does not exist or is not a directory"),
        ([f"model.path={tmp}/no_config"], "has no config.json, so it is not a transformers checkpoint directory"),
        ([f"model.path={tmp}/no_weights"], "has no safetensors weights (model.safetensors or model.safetensors"),
        ([f"model.path={tmp}/lost_shard"], "model.safetensors.index.json lists 'model-00002-of-00002.safetensors', "
                                           "which does not exist"),
        (["model.path=hf://twinkle/not-cached"], "model.path (--model): hf://twinkle/not-cached is not in the "
                                                 "Hugging Face cache"),
        ([f"train.output_dir={DATASET}/out"], f"train.output_dir (--output_dir): '{DATASET}/out' cannot be "
                                              f"created: '{DATASET}' is a file, not a directory"),
        ([f"train.resume_from_checkpoint={tmp}/checkpoint-9"], "train.resume_from_checkpoint "
                                                               "(--resume_from_checkpoint): "),
    ]


def test_each_check_before_launch_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Through the CLI's main, in this process: one line on stderr, status 2, no process group, nothing written."""
    import torch.distributed as dist

    from twinkle_strategy.train.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # tiny://demo would be built here: nothing may be
    out = tmp_path / "out"
    for overrides, expected in _cases(tmp_path / "inputs"):
        code = main([DEMO, f"data.dataset={DATASET}", f"train.output_dir={out}", *overrides])
        captured = capsys.readouterr()
        assert code == 2, (overrides, captured)
        assert captured.err.count("\n") == 1 and captured.err.startswith("twinkle-sft: error: "), captured.err
        assert expected in captured.err, (expected, captured.err)
        assert captured.out == ""
        assert not dist.is_initialized() and not out.exists() and not list(cwd.iterdir()), overrides

# ------------------------------------------------------------------- the pieces, without processes
def test_summary_groups_errors_by_rank_and_shows_the_first_traceback(tmp_path):
    from twinkle_strategy.train.rank_logs import failure_summary, record_error

    def raised(exc):
        try:
            raise exc
        except ValueError as caught:
            return caught

    run_dir = str(tmp_path)
    os.makedirs(tmp_path / "logs")
    record_error(run_dir, 1, raised(ValueError("rank 1's own problem")))  # first in time
    for rank in (0, 2):
        record_error(run_dir, rank, raised(ValueError("the shared problem")))
    summary = failure_summary(run_dir, [0, 1, 2, 3], [0, 1])
    assert "3 of 4 ranks raised an error" in summary
    assert "ValueError: the shared problem\n    raised on rank(s) [0, 2]" in summary
    assert "ValueError: rank 1's own problem\n    raised on rank(s) [1]" in summary
    assert "rank(s) [3] raised nothing" in summary
    assert "Traceback of rank 1, the first to fail:\nTraceback (most recent call last)" in summary
    assert summary.count("Traceback (most recent call last)") == 1


def test_log_follower_stops_at_the_fatal_traceback_only(tmp_path):
    from twinkle_strategy.train.rank_logs import LogFollower, record_error

    os.makedirs(tmp_path / "logs")
    log = tmp_path / "logs" / "rank0.log"
    seen = io.BytesIO()
    follower = LogFollower(str(tmp_path), 0, seen)
    log.write_bytes(b"step 1\rstep 2\nTraceback (most recent call last):\n  survived\npartial")
    follower.poll()  # no error recorded: a traceback the rank survived is shown like any output
    assert seen.getvalue() == b"step 1\rstep 2\nTraceback (most recent call last):\n  survived\n"
    record_error(str(tmp_path), 0, ValueError("fatal"))
    with open(log, "ab") as f:
        f.write(b" line\n[rank0]: Traceback (most recent call last):\n[rank0]:   fatal\n")
    follower.finish()
    assert seen.getvalue().endswith(b"survived\npartial line\n")


def test_after_a_restart_only_the_latest_attempts_errors_are_reported_and_followed(tmp_path):
    """torchrun restarted the ranks (launch.max_restarts) and the new attempt failed otherwise: the summary names
    the new attempt's errors, not the records the first attempt's processes left; the follower shows the new
    attempt's output after the first one's fatal traceback."""
    import json

    from twinkle_strategy.train.rank_logs import LogFollower, failure_summary, record_error

    run_dir = str(tmp_path)
    os.makedirs(tmp_path / "logs")
    for rank in (0, 1):
        record_error(run_dir, rank, ValueError("the first attempt's error"))
    for rank in (0, 1):  # the first attempt's records name this process; rewrite them to the first attempt's pid
        path = tmp_path / "logs" / f"rank{rank}.error.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "pid": 100 + rank}))
        (tmp_path / "logs" / f"rank{rank}.log").write_bytes(
            b"rank %d of 2 (node 0, local rank %d), pid %d: cli\nTraceback (most recent call last):\n  first\n"
            b"rank %d of 2 (node 0, local rank %d), pid %d: cli\nsecond attempt\r"
            % (rank, rank, 100 + rank, rank, rank, 200 + rank))
    summary = failure_summary(run_dir, [0, 1], [0])
    assert "the first attempt's error" not in summary and "no rank recorded a Python error" in summary, summary
    seen = io.BytesIO()
    follower = LogFollower(run_dir, 0, seen)
    follower.finish()
    assert seen.getvalue() == b"twinkle-sft: torchrun restarted the ranks; the new attempt's output follows\n" \
                              b"second attempt\r", seen.getvalue()
    record_error(run_dir, 1, ValueError("the second attempt's error"))  # this process: pid 200 + 1 stands for it
    path = tmp_path / "logs" / "rank1.error.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": 201}))
    summary = failure_summary(run_dir, [0, 1], [0])
    assert "1 of 2 ranks raised an error" in summary and "the second attempt's error" in summary, summary


def test_each_rank_runs_the_cli_module_with_the_interpreter_that_runs_the_launcher():
    """torchrun.cli_rank_program: every rank runs ``-m twinkle_strategy.train.cli`` with the launcher's arguments, and
    torchrun (whose ranks start with the interpreter that runs it) with this process's interpreter. The suite relies on
    the second: its ``twinkle-sft`` runs start under a stand-in interpreter whose ranks fork from a preloaded one
    (tests/preload.py, cli_command)."""
    import sys

    from twinkle_strategy.train.torchrun import cli_rank_program, torchrun_command

    command = torchrun_command(cli_rank_program(["demo.yaml", "train.max_steps=2"]), 2, 1, 2, 29500)
    assert command[-4:] == ["-m", "twinkle_strategy.train.cli", "demo.yaml", "train.max_steps=2"], command
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"], command


# ------------------------------------------- swift's flags as swift takes them; mistakes caught before launch
def test_flags_are_read_as_swift_reads_them():
    """Dashed spellings, --flag=value, flags and key=value in any order, and the flags of the README and
    docs/swift.md with swift's meaning."""
    from twinkle_strategy.train.cli import parse

    recipe = parse(["--max-steps", "2", "train.warmup_steps=1", DEMO, "--model", "tiny://demo", "--dataset", DATASET,
                    "--lora-dropout=0.05", "tuner.target_parameters=[]", "--torch_dtype", "bfloat16",
                    "--max_length", "128", "--warmup-ratio", "0.1", "--save_steps", "5", "--save_total_limit", "2",
                    "--logging_steps", "3", "--seed", "11"])
    assert (recipe.train.max_steps, recipe.tuner.lora_dropout, recipe.model.path, recipe.data.dataset) == \
        (2, 0.05, "tiny://demo", [DATASET])
    # Each flag's own value (the recipe has logging_steps 5, save_steps 20, seed 42, max_length 64).
    assert (recipe.model.dtype, recipe.data.max_length, recipe.train.warmup_ratio, recipe.train.save_steps,
            recipe.train.save_total_limit, recipe.train.logging_steps, recipe.train.seed,
            recipe.train.warmup_steps) == ("bfloat16", 128, 0.1, 5, 2, 3, 11, 1)
    # key=value wins over a flag, wherever each stands.
    for args in (["train.logging_steps=1", DEMO, "--logging_steps", "3"], ["--logging_steps", "3", DEMO,
                                                                           "train.logging_steps=1"]):
        assert parse(args).train.logging_steps == 1, args
    # A list flag stops at the next key=value, which may come before the recipe.
    recipe = parse(["--dataset", DATASET, DATASET, "train.max_steps=3", DEMO])
    assert recipe.data.dataset == [DATASET, DATASET] and recipe.train.max_steps == 3


def test_a_list_flag_stops_at_the_yaml_recipe(tmp_path):
    """``--dataset d.jsonl yaml/demo.yaml`` once took the recipe for a second dataset."""
    from twinkle_strategy.train.cli import parse, split_argv
    from twinkle_strategy.train.errors import RecipeError

    assert split_argv(["--dataset", DATASET, DEMO, "--max_steps", "3"]) == \
        ([DEMO], [("dataset", [DATASET]), ("max_steps", ["3"])])
    recipe = parse(["--dataset", DATASET, DATASET, DEMO])
    assert recipe.data.dataset == [DATASET, DATASET] and recipe.train.max_steps == 40  # demo.yaml's
    recipe_yml = tmp_path / "Recipe.YML"
    recipe_yml.write_text((REPO / "yaml" / "demo.yaml").read_text().replace("max_steps: 40", "max_steps: 7"))
    assert parse(["--target_modules", "q_proj", str(recipe_yml)]).train.max_steps == 7
    with pytest.raises(RecipeError) as raised:
        parse(["--dataset", DEMO])
    assert str(raised.value) == (f"--dataset needs a value before {DEMO} (a YAML file is the recipe), e.g. "
                                 "--dataset VALUE")


def test_every_flag_of_swift_sft_is_taken_with_its_meaning_or_refused_with_the_reason(capsys):
    """Each field of ms-swift 4.6.0's SftArguments (twinkle_strategy/train/swift_flags.py; tests/swift_plugin/test_swift.py checks
    the list against the installed swift) is a twinkle-sft flag, or one line with the reason, never a "did you
    mean" pointing at another flag (--use_cpu once got "did you mean --use_hf?")."""
    from twinkle_strategy.train.cli import SWIFT_FLAGS, main, split_argv
    from twinkle_strategy.train.errors import RecipeError
    from twinkle_strategy.train.swift_flags import SWIFT_FLAGS_NOT_TAKEN, SWIFT_SFT_FLAGS

    assert len(SWIFT_SFT_FLAGS) == len(set(SWIFT_SFT_FLAGS)) == 333
    assert set(SWIFT_FLAGS_NOT_TAKEN) <= set(SWIFT_SFT_FLAGS)  # no reason for a flag swift does not have
    taken = [flag for flag in SWIFT_SFT_FLAGS if flag in SWIFT_FLAGS]
    assert not set(taken) & set(SWIFT_FLAGS_NOT_TAKEN)
    for flag in SWIFT_SFT_FLAGS:
        if flag in SWIFT_FLAGS:
            continue
        for spelling in (f"--{flag}", f"--{flag.replace('_', '-')}"):
            with pytest.raises(RecipeError) as raised:
                split_argv([spelling, "1"])
            line = str(raised.value)
            assert line == f"swift's --{flag} is not a twinkle-sft flag: {SWIFT_FLAGS_NOT_TAKEN[flag]}", line
            assert "did you mean" not in line and "\n" not in line and len(line) < 300, line
    # The flags the README and docs/swift.md name, the list among them, are taken.
    for flag in ("lora_dropout", "torch_dtype", "max_length", "warmup_ratio", "save_steps", "save_total_limit",
                 "logging_steps", "seed", "truncation_strategy", "use_dora", "model", "dataset", "tuner_type",
                 "lora_rank", "lora_alpha", "target_modules", "target_parameters", "use_hf", "sequence_parallel_size"):
        assert flag in taken, flag
    # The ones the audit found answered by a "did you mean" to a different flag, through the CLI: one line each.
    for flag in ("freeze_vit", "freeze_llm", "freeze_aligner", "external_plugins", "use_cpu", "streaming",
                 "dataset_num_proc", "per_device_eval_batch_size", "save_strategy", "logging_dir"):
        assert main([DEMO, f"--{flag}", "x"]) == 2
        err = capsys.readouterr().err
        assert err == f"twinkle-sft: error: swift's --{flag} is not a twinkle-sft flag: " \
                      f"{SWIFT_FLAGS_NOT_TAKEN[flag]}\n", err
    assert "--device_type cpu" in SWIFT_FLAGS_NOT_TAKEN["use_cpu"]
    # A flag swift does not have either still gets the nearest one.
    with pytest.raises(RecipeError, match="unknown flag --lora_rnak; did you mean --lora_rank"):
        split_argv(["--lora_rnak", "8"])


def test_truncation_strategy_is_swifts(tmp_path):
    """swift 4.6 drops a row longer than --max_length (truncation_strategy delete, its default): twinkle-sft does
    too, and cuts it with right / left, as swift does."""
    from transformers import AutoTokenizer

    from twinkle_strategy.train.cli import parse
    from twinkle_strategy.train.data import SFTDataset
    from twinkle_strategy.train.demo_model import prepare_demo_model

    assert parse([DEMO]).data.truncation_strategy == "delete"
    assert parse([DEMO, "--truncation_strategy", "left"]).data.truncation_strategy == "left"
    model = tmp_path / "tiny"
    prepare_demo_model(str(model), [DATASET])
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = demo_rows(3)
    rows[1] = {"query": "What is 1 plus 1? " * 30, "response": "1 plus 1 is 2."}
    path = write_rows(tmp_path / "long.jsonl", rows)
    kept = {strategy: SFTDataset.from_jsonl(path, tokenizer, max_length=64, truncation_strategy=strategy)
            for strategy in ("delete", "right", "left")}
    assert len(kept["delete"]) == 2 and len(kept["left"]) == 3 and len(kept["right"]) == 2  # right: prompt only
    (skipped,) = kept["delete"].skipped
    assert skipped.line == 2 and skipped.reason.endswith("longer than max_length=64 (swift's default "
                                                         "truncation_strategy delete drops such rows; raise "
                                                         "data.max_length, or set data.truncation_strategy=right to "
                                                         "cut them)"), skipped
    long_row = kept["left"].examples[1]
    assert len(long_row["input_ids"]) == 64 and long_row["labels"][-1] != -100  # its end, the response, kept
    assert kept["right"].skipped[0].reason.startswith("nothing to train on after truncation to max_length=64")

@pytest.mark.parametrize("args,expected,fix", MISTAKES, ids=MISTAKE_IDS)
def test_each_mistake_is_one_line_before_launch_and_its_fix_passes(args, expected, fix, tmp_path, monkeypatch,
                                                                   capsys):
    """The CLI's main, in this process: status 2, one line naming key and flag, nothing written, no process
    group; then the suggested fix passes every check made before launch."""
    import torch.distributed as dist

    from twinkle_strategy.train.cli import main, parse
    from twinkle_strategy.train.preflight import check_before_launch

    monkeypatch.chdir(tmp_path)  # tiny://demo would be built here: nothing may be
    for var in ("NPROC_PER_NODE", "NNODES", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    base = [DEMO, f"data.dataset={DATASET}", f"train.output_dir={out}"]
    code = main([*base, *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err == f"twinkle-sft: error: {expected}\n" or (
        captured.err.startswith(f"twinkle-sft: error: {expected}") and captured.err.count("\n") == 1), captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == [] and not dist.is_initialized()
    check_before_launch(parse([*base, *fix]))
    assert list(tmp_path.iterdir()) == []


def test_each_fix_is_what_its_line_says_and_each_is_launched():
    """Cheap: the table below the mistakes is complete, and each fix does what its one line says."""
    mistakes = dict(zip(MISTAKE_IDS, MISTAKES, strict=True))
    assert set(FIX_SAID) == set(mistakes)
    for mistake_id, (args, expected, fix) in mistakes.items():
        said = FIX_SAID[mistake_id]
        assert said in expected, mistake_id
        if said.startswith("set "):
            assert said.removeprefix("set ") in fix, mistake_id
        elif said.startswith("e.g. "):
            assert said.removeprefix("e.g. ") in " ".join(fix), mistake_id
        elif said.startswith("did you mean "):
            name = said.removeprefix("did you mean ").rstrip("?")
            assert name in fix or any(token.startswith(f"{name}=") for token in fix), mistake_id
        elif said.startswith("choose ep_size among "):
            chosen = fix[fix.index("--expert_parallel_size") + 1] if "--expert_parallel_size" in fix else \
                next(t for t in fix if t.startswith("strategy.ep_size=")).split("=")[1]
            assert int(chosen) in json.loads(said.removeprefix("choose ep_size among ")), mistake_id
        elif said.startswith("use delete"):
            assert fix[fix.index("--truncation_strategy") + 1] in ("delete", "right", "left"), mistake_id
        else:  # drop the flag swift takes and twinkle-sft does not
            assert said == "drop it" and [t for t in args if t not in fix] == ["--deepspeed", "zero3"], mistake_id
    launched = [fix_id for _, fix_ids in FIX_LAUNCHES for fix_id in fix_ids]
    assert sorted(launched + list(SAME_KIND)) == sorted(MISTAKE_IDS)  # each one launched, or its kind is
    assert all(kind in launched for kind in SAME_KIND.values())

def test_world_size_fix_names_the_setting_the_launch_reads(monkeypatch, capsys, tmp_path):
    """With swift's NPROC_PER_NODE set, it wins over launch.nproc_per_node, so the fix names it (issue 31 point 5:
    the fix once named the other one, and failed the same way)."""
    from twinkle_strategy.train import cli
    from twinkle_strategy.train.recipe import planned_world_size

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "1")
    args = [DEMO, f"data.dataset={DATASET}", "strategy.ep_size=4"]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        "twinkle-sft: error: strategy.ep_size (--expert_parallel_size): ep_size 4 needs a multiple of 4 processes, "
        "this run has 2 (the launch's world size); set NPROC_PER_NODE=2, or ep_size among [1, 2]\n")
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    recipe = cli.parse(args)
    # The simulated nodes the demo launches read the same variable: 2 nodes x 2 ranks, the world it was checked for.
    assert planned_world_size(recipe) == 4 == cli.simulated_launch_shape(recipe).world_size

def test_startup_line_tells_declared_ranges_from_tested_versions():
    """The run's start-up line says in one line what ``--version`` says in four. Issue 36: torch 2.15.0, allowed by
    torch>=2.13 but never run by the suite, was called "within the tested ranges"; now a version is within or
    OUTSIDE its declared range, and a tested version or not."""
    from packaging.specifiers import SpecifierSet

    from twinkle_strategy.train.versions import PackageVersion, startup_line, version_text

    tested = [PackageVersion("torch", "2.13.0+cpu", SpecifierSet(">=2.13")),
              PackageVersion("transformers", "5.24.0", SpecifierSet(">=5.19,<5.25")),
              PackageVersion("peft", "0.21.2", SpecifierSet(">=0.20,<0.22"))]
    assert startup_line(tested).endswith(" with torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2: tested versions; "
                                         "within the declared ranges (twinkle-sft --version)")
    untested = [PackageVersion("torch", "2.15.0", SpecifierSet(">=2.13")), *tested[1:]]
    assert startup_line(untested).endswith(": within the declared ranges; torch 2.15.0 is not a tested version "
                                           "(tested: 2.13.0, 2.14.1) (twinkle-sft --version)"), startup_line(untested)
    assert "  torch 2.15.0 (declared torch>=2.13; tested 2.13.0, 2.14.1; not a tested version)" in \
        version_text(untested)
    outside = [tested[0], PackageVersion("transformers", "5.25.0", SpecifierSet(">=5.19,<5.25")), tested[2]]
    line = startup_line(outside)
    assert line.endswith(": transformers 5.25.0 is OUTSIDE the declared range transformers<5.25,>=5.19 "
                         "(twinkle-sft --version)") and "\n" not in line, line
    assert "  transformers 5.25.0 (declared transformers<5.25,>=5.19; tested 5.19.0, 5.24.0; OUTSIDE the declared " \
           "range)" in version_text(outside)
    unknown = [PackageVersion("torch", "2.14.1", None), *tested[1:]]
    assert startup_line(unknown).endswith(": tested versions; declared ranges unknown (twinkle_strategy is on "
                                          "PYTHONPATH, not installed) (twinkle-sft --version)"), startup_line(unknown)
