"""The swift leg of "one meaning of sequence_parallel_size" (issue 36; tests/multiproc/test_one_sp_meaning.py has the
twinkle-sft and transformers.Trainer legs): the same recipe (the demo: LoRA on attention and experts, ep=2,
memory_efficient_init, fp32) through ``swift sft`` with the twinkle plugin at 2 simulated nodes x 2 ranks with
``--sequence_parallel_size 2`` trains on the recipe's examples in each step (the two ranks of a group share theirs)
and logs the loss and gradient norm of the transformers.Trainer leg (tests/workers/one_sp_meaning.py) run in
ms-swift's own environment, so that every compared number comes from the same versions.

swift draws rows with its own sampler: unshuffled, data-parallel rank r takes rows r, r + dp, ... while
transformers' takes whole batches in turn, so the two legs split a step's rows into other micro-batches; the
rows of a step, the loss and the gradient norm (token-weighted over the step's rows) are the same (measured:
within 1e-7, the 8 digits swift logs). Both legs get
the rows in the order twinkle's step sampler takes them (the HF leg as its worker does; swift from a JSONL file
written in that order, unshuffled): the examples of each step are the recipe's, whatever the front-end.
Two launches: the swift run and the HF leg's worker, both 2 x 2.

One step (issue 44): swift's log lines carry the step fields of the other front-ends (twinkle_strategy.step.metrics,
tests/multiproc/test_one_sp_meaning.py compares twinkle-sft's and the HF leg's): the same names, the same tokens
(each step's examples' real tokens, exactly) and the same FLOPs per token as the HF leg's, although swift groups
the step's rows into other micro-batches (each example's attention length, measured on its whole row). Also with
``--padding_free true`` (each micro-batch's examples flattened into one row: the same examples, so the same losses and
the same fields): one launch more.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from multinode import launch
from test_swift import DATASET, REPO, logged_steps, run_swift_sft

ATOL = 1e-5  # fp32: the same computation, cut the same way
STEPS = 4
PER_DEVICE, ACCUMULATION, WORLD, SP = 2, 2, 4, 2
DP = WORLD // SP
DEMO = str(REPO / "yaml" / "demo.yaml")
# The step fields every front-end logs on CPU (no mfu: the device's peak is unknown).
STEP_FIELDS = {"tokens", "tokens_per_second", "flops_per_token", "tflops_per_device"}
# The recipe of yaml/demo.yaml as swift's flags (swift's own defaults differ: weight decay 0.1, beta2 0.95, LoRA
# dropout 0.05, no warmup, shuffled data).
SWIFT_RECIPE = ["--tuner_type", "lora", "--lora_rank", "8", "--lora_alpha", "32", "--lora_dropout", "0",
                "--target_modules", "q_proj", "k_proj", "v_proj", "o_proj",
                "--target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                "--max_length", "64", "--truncation_strategy", "delete", "--max_steps", str(STEPS),
                "--per_device_train_batch_size", str(PER_DEVICE), "--gradient_accumulation_steps", str(ACCUMULATION),
                "--learning_rate", "5e-3", "--lr_scheduler_type", "cosine", "--warmup_ratio", "0.05",
                "--weight_decay", "0", "--adam_beta1", "0.9", "--adam_beta2", "0.999", "--adam_epsilon", "1e-8",
                "--max_grad_norm", "1.0", "--seed", "42", "--save_steps", "100",
                "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false",
                "--sequence_parallel_size", str(SP)]


def recipe_examples(model: Path) -> tuple[list[tuple[int, ...]], list[list[int]], list[dict]]:
    """The demo rows as twinkle-sft tokenizes them, twinkle's step sampler's rows of each step, and the JSON rows."""
    from transformers import AutoTokenizer

    from twinkle_strategy.train.data import StepSampler, has_labels, tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()]
    tokens = [tokenize_conversation(tokenizer, row["messages"]) for row in rows]
    # Every row fits max_length 64 and has labels: the dataset's index i is the file's row i.
    assert all(len(t["input_ids"]) <= 64 and has_labels(t) for t in tokens)
    sampler = StepSampler(len(rows), per_step=PER_DEVICE * DP * ACCUMULATION, seed=42)
    return [tuple(t["input_ids"]) for t in tokens], [sampler.rows(step) for step in range(STEPS)], rows


@pytest.fixture(scope="module")
def legs(swift_bin, tiny_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("swift_one_sp")
    ids, step_rows, rows = recipe_examples(tiny_model)
    ordered = root / "recipe_order.jsonl"
    ordered.write_text("".join(json.dumps(rows[i]) + "\n" for step in step_rows for i in step))
    (root / "swift").mkdir()
    swift = run_swift_sft(swift_bin, tiny_model, root / "swift", SWIFT_RECIPE,
                          {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1", "TWINKLE_PROBE_BATCHES": "1"},
                          nnodes=2, timeout=600, dataset=ordered)
    recipe = [DEMO, f"model.path={tiny_model}", f"data.dataset={DATASET}", "launch.nnodes=2", "launch.nproc_per_node=2",
              f"train.max_steps={STEPS}", "train.logging_steps=1", "train.save_steps=100",
              f"train.per_device_train_batch_size={PER_DEVICE}", f"train.gradient_accumulation_steps={ACCUMULATION}",
              "--sequence_parallel_size", str(SP), f"train.output_dir={root / 'unused'}"]
    hf = launch("one_sp_meaning.py", recipe, root / "hf", nnodes=2, nproc_per_node=2, timeout=600,
                python=str(swift_bin / "python"))
    assert hf.ok(), hf.describe()
    return {"ids": ids, "step_rows": step_rows, "swift": swift, "hf": hf.rank_results(), "ordered": ordered}


def test_swift_sft_trains_each_step_on_the_recipes_examples_shared_by_the_group(legs):
    ids, swift = legs["ids"], legs["swift"]
    assert "sequence_parallel_size=2" in swift["log"] and "world_size=4, nodes=2" in swift["log"]
    ranks = swift["ranks"]
    for rank, data in ranks.items():
        batches = data["micro_batches"]
        assert len(batches) == STEPS * ACCUMULATION and all(len(b) == PER_DEVICE for b in batches), (rank, batches)
    # The ranks of a group train on the same rows, each on its part of every sequence (the plugin splits them
    # before the trainer's step): the group's parts, in rank order, make whole rows of the recipe.
    groups = {group: [[[token for part in parts for token in part] for parts in zip(*rows, strict=True)]
                      for rows in zip(*(ranks[r]["micro_batches"] for r in range(group * SP, (group + 1) * SP)),
                                      strict=True)]
              for group in range(DP)}
    assert all(part for r in range(0, WORLD, SP) for batch in ranks[r]["micro_batches"] for part in batch)
    assert any(part for r in range(1, WORLD, SP) for batch in ranks[r]["micro_batches"] for part in batch)
    for step, rows in enumerate(legs["step_rows"]):
        trained = [tuple(row) for group in range(DP) for micro in range(ACCUMULATION)
                   for row in groups[group][step * ACCUMULATION + micro]]
        assert Counter(trained) == Counter(ids[i] for i in rows), step
    # the HF leg, in this environment, on the same rows
    hf = legs["hf"]
    assert [[ids[i] for i in rows] for rows in legs["step_rows"]] == [[ids[i] for i in rows]
                                                                       for rows in hf[0]["step_rows"]]


def test_swift_sft_logs_the_losses_of_the_transformers_trainer_leg(legs):
    swift = legs["swift"]
    assert sorted(swift["losses"]) == list(range(1, STEPS + 1)), swift["losses"]
    got = [[swift["losses"][s], swift["grad_norms"][s]] for s in range(1, STEPS + 1)]
    for rank, result in legs["hf"].items():
        expected = [list(pair) for pair in zip(result["losses"], result["grad_norms"], strict=True)]
        assert len(expected) == STEPS, (rank, expected)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0,
                                   msg=lambda m, r=rank: f"swift against HF rank {r} (loss, grad_norm) per step: {m}")


@pytest.fixture(scope="module")
def swift_padding_free(swift_bin, tiny_model, tmp_path_factory, legs) -> dict:
    """The swift leg again with ``--padding_free true`` (the same rows file, in the recipe's order)."""
    root = tmp_path_factory.mktemp("swift_one_sp_padding_free")
    return run_swift_sft(swift_bin, tiny_model, root, [*SWIFT_RECIPE, "--padding_free", "true"],
                         {"TWINKLE_EP_SIZE": "2", "TWINKLE_MEMORY_EFFICIENT_INIT": "1"}, nnodes=2, timeout=600,
                         dataset=legs["ordered"])


def step_lines(run: dict) -> list[dict]:
    """swift's training log lines (logging.jsonl), in step order, each with only its step fields."""
    with open(run["run_dir"] / "logging.jsonl") as f:
        lines = [json.loads(line) for line in f]
    lines = [line for line in lines if "loss" in line and "global_step/max_steps" in line]
    assert [int(line["global_step/max_steps"].split("/")[0]) for line in lines] == list(range(1, STEPS + 1))
    return [{k: v for k, v in line.items() if k in STEP_FIELDS | {"mfu"}} for line in lines]


def test_swift_sft_padding_free_logs_the_losses_of_the_transformers_trainer_leg(legs, swift_padding_free):
    _, losses, grad_norms = logged_steps(swift_padding_free["run_dir"].parent.parent)
    got = [[losses[s], grad_norms[s]] for s in range(1, STEPS + 1)]
    expected = [list(pair) for pair in zip(legs["hf"][0]["losses"], legs["hf"][0]["grad_norms"], strict=True)]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"padding-free swift against HF: {m}")


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_swift_sft_logs_the_step_fields_of_the_transformers_trainer_leg(legs, swift_padding_free, layout):
    swift = step_lines(legs["swift"] if layout == "padded" else swift_padding_free)
    lengths = [[len(legs["ids"][i]) for i in rows] for rows in legs["step_rows"]]
    assert [line["tokens"] for line in swift] == [sum(step) for step in lengths]
    for line in swift:
        assert set(line) == STEP_FIELDS, line
        assert line["tokens_per_second"] > 0 < line["tflops_per_device"]
    for rank, result in legs["hf"].items():
        assert result["step_lengths"] == lengths, rank
        hf = [{k: v for k, v in line.items() if k in STEP_FIELDS | {"mfu"}} for line in result["step_fields"]]
        assert [set(line) for line in hf] == [set(line) for line in swift], rank
        for key in ("tokens", "flops_per_token"):
            assert [line[key] for line in swift] == [line[key] for line in hf], (layout, rank, key, swift, hf)
