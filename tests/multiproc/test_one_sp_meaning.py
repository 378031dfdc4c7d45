"""One meaning of sequence_parallel_size in every front-end (issue 36): the ranks of a sequence-parallel group share
their examples, data-parallel size = world / sp, global batch = per-device batch x accumulation x world / sp.

The same recipe (the demo: LoRA on attention and experts, ep=2, memory_efficient_init, fp32) at 2 simulated nodes x
2 ranks with sequence_parallel_size=2 trains through ``twinkle-sft`` (twinkle's Trainer) and through
``with_strategy(transformers.Trainer)`` (the HF/TRL mixin, which the swift plugin builds on): each step trains on the
same examples and logs the same loss and gradient norm. Two launches.

One step (issue 44): the two also log the same step fields (twinkle_strategy.step.metrics): the same names, the
same token counts (each step's examples' real tokens, exactly) and the same FLOPs per token (the attention length
measured on whole rows: each example's own), on padded rows and on padding-free rows (each micro-batch's examples
flattened into one row, ``--padding_free true``: the same examples, so the same losses and the same fields). Two
launches more.

The swift leg (``swift sft`` at 2x2 with sp=2, padded and padding-free) runs in ms-swift's environment:
tests/swift_plugin/test_swift_one_sp_meaning.py, against this HF leg's worker run there (the same versions for
every number it compares).
"""

from __future__ import annotations

import pytest
import torch
from multinode import launch
from test_launch_errors import DEMO
from test_trainer_cli import DATASET, only_run_dir, read_log, run_cli
from transformers import AutoConfig

from twinkle_strategy.train.demo_model import prepare_demo_model

ATOL = 1e-5  # fp32: the same computation, cut the same way
STEPS = 4
PER_DEVICE, ACCUMULATION, WORLD, SP = 2, 2, 4, 2
# The step fields every front-end logs on CPU (no mfu: the device's peak is unknown).
STEP_FIELDS = {"tokens", "tokens_per_second", "flops_per_token", "tflops_per_device"}
LAYOUTS = {"padded": [], "padding_free": ["--padding_free", "true"]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"one_sp_meaning_{request.param}")
    model = prepare_demo_model(str(root / "model"), DATASET)
    recipe = [DEMO, f"model.path={model}", f"data.dataset={DATASET}", "launch.nnodes=2", "launch.nproc_per_node=2",
              f"train.max_steps={STEPS}", "train.logging_steps=1", "train.save_steps=100",
              f"train.per_device_train_batch_size={PER_DEVICE}", f"train.gradient_accumulation_steps={ACCUMULATION}",
              "--sequence_parallel_size", str(SP), *LAYOUTS[request.param]]
    proc = run_cli([*recipe, f"train.output_dir={root / 'twinkle'}"], cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf = launch("one_sp_meaning.py", [*recipe, f"train.output_dir={root / 'unused'}"], root / "hf", nnodes=2,
                nproc_per_node=2, timeout=600)
    assert hf.ok(), hf.describe()
    return {"twinkle": read_log(only_run_dir(root / "twinkle")), "hf": hf.rank_results(), "model": model}


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


def step_fields(line: dict) -> dict:
    """A log line's step fields (twinkle_strategy.step.metrics), by name."""
    return {k: v for k, v in line.items() if k in STEP_FIELDS | {"mfu"}}


def test_twinkle_sft_and_the_transformers_trainer_log_the_same_step_fields(runs):
    """The same field names, the same tokens (each step's examples' real tokens: exact) and the same FLOPs per token
    (the attention length of each example on its whole row, whichever front-end cut, grouped or flattened the
    rows). tokens_per_second and tflops_per_device are those over the step's wall clock."""
    twinkle = [step_fields(line) for line in runs["twinkle"]]
    lengths = runs["hf"][0]["step_lengths"]
    assert [line["tokens"] for line in twinkle] == [sum(step) for step in lengths]
    for line in twinkle:
        assert set(line) == STEP_FIELDS, line
        assert line["tokens_per_second"] > 0 < line["tflops_per_device"]
    # FLOPs per token = 6 x active parameters + 12 x layers x attention width x the attention length, which is each
    # example's length weighted by its tokens: steps differ by the attention term alone.
    attention = [sum(n * n for n in step) / sum(step) for step in lengths]
    config = AutoConfig.from_pretrained(runs["model"])
    per_length = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    assert len(set(attention)) > 1, attention
    for line, length in zip(twinkle, attention, strict=True):
        expected = twinkle[0]["flops_per_token"] + per_length * (length - attention[0])
        assert line["flops_per_token"] == pytest.approx(expected, abs=0.01), (twinkle, attention)
    for rank, result in runs["hf"].items():
        hf = [step_fields(line) for line in result["step_fields"]]
        assert [set(line) for line in hf] == [set(line) for line in twinkle], rank
        for key in ("tokens", "flops_per_token"):
            assert [line[key] for line in hf] == [line[key] for line in twinkle], (rank, key, hf, twinkle)
