"""Every launch checks the fit first: twinkle-sft refuses, before any process starts, a run its plan says
will not fit (test_trainer_cli's demo_run launches the same recipe with a budget just over the peak). Through the
CLI's main, in this process: the check comes before any launch, so none is needed to see it (the plans take
minutes on 2 cores: this file stays out of tests/unit)."""

import contextlib
import io
import json
from types import SimpleNamespace

from multinode import REPO

from twinkle_strategy.train.cli import main
from twinkle_strategy.train.fit_check import check_fit_before_launch
from twinkle_strategy.train.recipe import load_recipe

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
DEMO = [str(REPO / "yaml" / "demo.yaml"), f"data.dataset={DATASET}", "train.max_steps=8", "train.save_steps=4",
        "train.logging_steps=1"]


def twinkle_sft(args, cwd):
    """``twinkle-sft ARGS`` run from ``cwd``: its status and what it printed."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(args)
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


def test_a_run_that_will_not_fit_is_refused_in_one_line_before_any_process_starts(tmp_path):
    out = tmp_path / "out"
    recipe = [*DEMO, f"train.output_dir={out}"]
    planned = twinkle_sft(["plan", *recipe, "--json"], cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    peak = plan["step_peak_bytes"]
    refused = twinkle_sft([*recipe, "--device_memory", str(peak - 1)], cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("twinkle-sft: error: the memory plan's step peak"), lines
    assert f"{peak / 2**20:.2f} MiB" in lines[0] and f"{(peak - 1) / 2**20:.2f} MiB" in lines[0]
    assert "first fix: " in lines[0] and "--skip_plan true" in lines[0]
    assert not out.exists()  # no run directory: nothing was launched


def test_the_plan_command_says_whether_it_fits(tmp_path):
    recipe = [*DEMO, f"train.output_dir={tmp_path / 'out'}"]
    fits = twinkle_sft(["plan", *recipe, "--device_memory", "1GiB"], cwd=tmp_path)
    assert fits.returncode == 0 and "step peak, per rank" in fits.stdout and fits.stdout.rstrip().splitlines()[-1] \
        .startswith("fits: step peak"), fits.stdout[-3000:] + fits.stderr[-3000:]
    assert "sharded parameters" in fits.stdout and "EP all-to-alls" in fits.stdout and "assumptions:" in fits.stdout


def test_skip_plan_or_no_budget_launches_without_the_check(tmp_path, monkeypatch):
    model = REPO / "twinkle_strategy" / "planning" / "configs" / "qwen3-30b-a3b"
    monkeypatch.chdir(tmp_path)
    base = [f"model.path={model}", f"data.dataset=[{DATASET}]", "launch.nproc_per_node=8", "strategy.ep_size=8"]
    assert "exceeds the budget 1.00 GiB" in check_fit_before_launch(load_recipe(None, [*base,
                                                                                      "launch.device_memory=1GiB"]))
    assert check_fit_before_launch(load_recipe(None, [*base, "launch.device_memory=1GiB",
                                                      "launch.skip_plan=true"])) is None
    # No device memory found on this CPU machine and none given: no check (a GPU's own memory is the budget).
    assert check_fit_before_launch(load_recipe(None, base)) is None
