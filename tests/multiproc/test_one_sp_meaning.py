"""One meaning of sequence_parallel_size in every front-end (issue 36): the ranks of a sequence-parallel group share
their examples, data-parallel size = world / sp, global batch = per-device batch x accumulation x world / sp.

The same recipe (the demo: LoRA on attention and experts, ep=2, memory_efficient_init, fp32) at 2 simulated nodes x
2 ranks with sequence_parallel_size=2 trains through ``twinkle-sft`` (twinkle's Trainer) and through
``with_strategy(transformers.Trainer)`` (the HF/TRL mixin, which the swift plugin builds on): each step trains on the
same examples and logs the same loss and gradient norm. Two launches. The swift leg (``swift sft`` at 2x2 with
sp=2) runs in ms-swift's environment: tests/swift_plugin/test_swift_one_sp_meaning.py, against this HF leg's worker
run there (the same versions for every number it compares).
"""

from __future__ import annotations

import pytest
import torch
from multinode import launch
from test_launch_errors import DEMO
from test_trainer_cli import DATASET, only_run_dir, read_log, run_cli

from twinkle_strategy.train.demo_model import prepare_demo_model

ATOL = 1e-5  # fp32: the same computation, cut the same way
STEPS = 4
PER_DEVICE, ACCUMULATION, WORLD, SP = 2, 2, 4, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("one_sp_meaning")
    model = prepare_demo_model(str(root / "model"), DATASET)
    recipe = [DEMO, f"model.path={model}", f"data.dataset={DATASET}", "launch.nnodes=2", "launch.nproc_per_node=2",
              f"train.max_steps={STEPS}", "train.logging_steps=1", "train.save_steps=100",
              f"train.per_device_train_batch_size={PER_DEVICE}", f"train.gradient_accumulation_steps={ACCUMULATION}",
              "--sequence_parallel_size", str(SP)]
    proc = run_cli([*recipe, f"train.output_dir={root / 'twinkle'}"], cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf = launch("one_sp_meaning.py", [*recipe, f"train.output_dir={root / 'unused'}"], root / "hf", nnodes=2,
                nproc_per_node=2, timeout=600)
    assert hf.ok(), hf.describe()
    return {"twinkle": read_log(only_run_dir(root / "twinkle")), "hf": hf.rank_results()}


def test_each_step_trains_on_the_recipes_examples_shared_by_the_group(runs):
    ranks = runs["hf"]
    assert sorted(ranks) == list(range(WORLD))
    for rank, result in ranks.items():
        # Consecutive ranks form a group: the same data-parallel share, the same micro-batches.
        assert result["dp_rank"] == rank // SP
        assert result["micro_batches"] == ranks[rank - rank % SP]["micro_batches"], rank
        assert len(result["micro_batches"]) == STEPS * ACCUMULATION and all(
            len(batch) == PER_DEVICE for batch in result["micro_batches"]), result["micro_batches"]
    step_rows = ranks[0]["step_rows"]
    assert len(step_rows) == STEPS and all(len(rows) == PER_DEVICE * ACCUMULATION * WORLD // SP for rows in step_rows)
    for step, rows in enumerate(step_rows):
        trained = [i for rank in range(0, WORLD, SP) for micro in range(ACCUMULATION)
                   for i in ranks[rank]["micro_batches"][step * ACCUMULATION + micro]]
        # twinkle's step sampler's rows of the step: micro-batch after micro-batch, data-parallel share after share
        assert sorted(trained) == sorted(rows), (step, trained, rows)


def test_twinkle_sft_and_the_transformers_trainer_log_the_same_losses(runs):
    twinkle = runs["twinkle"]
    assert [line["global_step/max_steps"] for line in twinkle] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]
    expected = [[line["loss"], line["grad_norm"]] for line in twinkle]
    for rank, result in runs["hf"].items():
        assert len(result["losses"]) == len(result["grad_norms"]) == STEPS, (rank, result["losses"])
        got = [list(pair) for pair in zip(result["losses"], result["grad_norms"], strict=True)]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r} (loss, grad_norm) per step: {m}")
