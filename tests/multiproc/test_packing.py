"""Padding-free packing (data.packing, data.padding_free): each packed example trains as if it were alone.

Oracle: one process, the same checkpoint and dtype, the same examples one per padded row
(attention_mask). The distributed side is the Trainer's own step (EP + FSDP2, packs flattened into one
row per micro-batch, gradient accumulation, activation checkpointing) on simulated nodes
(tests/workers/packing_parity.py).

bf16 tolerances (u = 2^-8, bf16's unit roundoff). Packing changes every matmul's shape from the first
layer on (one row of N tokens instead of B padded rows), EP computes experts on several ranks' tokens and
FSDP sums gradients across ranks, so each operation rounds differently, by up to u relative, a few
roundings per layer over 2 layers. Averages over many tokens cancel much of that:
* step loss (a mean over ~250-350 tokens): u relative (measured 0.02 u);
* one example's loss (a mean over 2 to 30 tokens): 2 u relative (measured 0.2 u);
* gradient norm, which also moves where a token changed experts: 8 u relative (measured 0.12 u).
A packed example that attended to its neighbours moves its loss by ~1% (~3 u): the bf16 check still sees it.
"""

import math

import pytest
import torch
from multinode import launch

from twinkle_strategy.errors import PackingError
from twinkle_strategy.testing.tiny_models import build_tiny_model, save_tiny_checkpoint
from twinkle_strategy.train.packing import (
    BatchLayout,
    DataCollatorForPacking,
    Pack,
    attention_length,
    check_packable,
    pack_examples,
    prepare_for_packed_batches,
    real_token_count,
)

U = 2.0 ** -8
FP32_TOLERANCE = 1e-5
BF16_LOSS, BF16_EXAMPLE, BF16_NORM = U, 2 * U, 8 * U


def example(n: int, first: int = 1) -> dict[str, list[int]]:
    ids = [(first + i) % 100 + 1 for i in range(n)]
    return {"input_ids": ids, "labels": [-100] + ids[1:]}


def test_packs_fit_max_length_are_deterministic_and_keep_every_example():
    examples = [example(n, first=i) for i, n in enumerate([30, 3, 17, 9, 40, 5, 12, 26, 7, 44])]
    packs = pack_examples(examples, 48)
    assert all(len(p) <= 48 for p in packs)
    assert sorted(e["input_ids"] for p in packs for e in p.examples) == sorted(e["input_ids"] for e in examples)
    assert packs == pack_examples(examples, 48)  # the same packs on every rank and after a resume
    # Best-fit decreasing: 193 tokens in the fewest packs of 48 there can be.
    assert len(packs) == math.ceil(sum(len(e["input_ids"]) for e in examples) / 48) == 5


def test_collator_flattens_with_per_example_positions_and_no_mask():
    a, b = example(4), example(3, first=50)
    batch = DataCollatorForPacking()([Pack((a, b)), example(2, first=70)])
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 9)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    # Every example's first label is -100: the last token of one example does not predict the next one's first.
    assert batch["labels"][0, [0, 4, 7]].tolist() == [-100] * 3
    assert real_token_count(batch) == 9
    assert attention_length(batch) == pytest.approx((16 + 9 + 4) / 9)
    assert BatchLayout.of(packing=False, padding_free=True).flattened
    assert not BatchLayout.of(packing=False, padding_free=False).flattened


def test_packed_logits_equal_each_example_alone_in_one_process():
    """transformers' own packed-sequence masks (sdpa) keep examples apart, once the KV cache is off."""
    model = build_tiny_model("qwen3_moe")
    examples = [example(n, first=7 * n) for n in (5, 11, 3)]
    batch = DataCollatorForPacking()(examples)
    with torch.no_grad():
        crossing = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        prepare_for_packed_batches(model)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples])
    assert (packed - alone).abs().max() <= FP32_TOLERANCE
    # With the cache on (transformers' default, in training too) the same batch attends across examples.
    assert (crossing - alone).abs().max() > 0.1


@pytest.mark.parametrize("family,reason", [
    ("qwen3_next", "its layers of type ['linear_attention'] mix tokens along the sequence"),
    ("qwen3_5_moe_vl", "its layers of type ['linear_attention']"),
    ("nemotron_h", "its layers of type ['linear_attention']"),
    ("jamba", "its layers of type ['linear_attention', 'mamba']"),
    ("gpt_oss", "GptOssModel.forward builds its attention masks without position_ids"),
])
def test_families_that_would_mix_packed_examples_are_refused_by_name(family, reason):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.testing.tiny_models import tiny_config

    config = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PackingError, match=f"cannot train {config.get_text_config().model_type}: "
                                           + reason.replace("[", r"\[").replace("]", r"\]")):
        check_packable(model)


def test_a_refusal_names_the_option_of_the_front_end_that_asked_for_packing():
    """Issue 36: the library's refusal once told HF Trainer and swift users to set data.packing and --packing. The
    library names the batches; each front-end names its own option and how to turn it off."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.integrations.swift.parts.hooks import SWIFT_PACKING
    from twinkle_strategy.integrations.transformers.sequence import TRAINER_PACKING
    from twinkle_strategy.sequence.packed import PackingOption
    from twinkle_strategy.testing.tiny_models import tiny_config
    from twinkle_strategy.train.packing import RECIPE_PACKING

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    for option, says in [(PackingOption(), "packed batches (position_ids restarting at every example)"),
                         (RECIPE_PACKING, "data.packing / data.padding_free"),
                         (SWIFT_PACKING, "--packing / --padding_free"),
                         (TRAINER_PACKING, "packed rows (DataCollatorWithFlattening, TRL's padding_free or packing)")]:
        with pytest.raises(PackingError) as raised:
            check_packable(model, option=option)
        assert str(raised.value).startswith(f"{says} cannot train qwen3_next: ") and \
            str(raised.value).endswith(f"; {option.turn_off}"), str(raised.value)
    library = str(pytest.raises(PackingError, check_packable, model).value)
    assert "data." not in library and "--" not in library, library


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "llama4"])
def test_attention_families_are_packable(family):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.testing.tiny_models import tiny_config

    with torch.device("meta"):
        check_packable(AutoModelForCausalLM.from_config(tiny_config(family)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    for family in ("qwen3_moe", "qwen3_next"):
        save_tiny_checkpoint(family, str(root / family), max_shard_size="40KB")  # hub layout, several files
    return root


def check_against_one_process(ranks: dict, *, loss_tol: float, example_tol: float, norm_tol: float,
                              relative: bool) -> dict:
    """Every case: step loss and grad norm on every rank, and every example's loss, against rank 0's reference."""
    worst = {"loss": 0.0, "example": 0.0, "norm": 0.0}
    for i, case in enumerate(ranks[0]["cases"]):
        ref = case["ref"]
        scale = (lambda x: abs(x)) if relative else (lambda x: 1.0)
        seen = {}
        for data in ranks.values():
            c = data["cases"][i]
            assert c["tokens"] == c["step_tokens"], f"{c['name']}: tokens_per_second counts padding or misses tokens"
            worst["loss"] = max(worst["loss"], abs(c["loss"] - ref["loss"]) / scale(ref["loss"]))
            worst["norm"] = max(worst["norm"], abs(c["grad_norm"] - ref["grad_norm"]) / scale(ref["grad_norm"]))
            assert abs(c["loss"] - ref["loss"]) <= loss_tol * scale(ref["loss"]), (c["name"], c["loss"], ref["loss"])
            worst["aux"] = max(worst.get("aux", 0.0), abs(c["aux_loss"] - ref["aux_loss"]) / scale(ref["aux_loss"] or 1))
            assert abs(c["aux_loss"] - ref["aux_loss"]) <= loss_tol * scale(ref["aux_loss"] or 1), \
                (c["name"], c["aux_loss"], ref["aux_loss"])
            assert abs(c["grad_norm"] - ref["grad_norm"]) <= norm_tol * scale(ref["grad_norm"]), \
                (c["name"], c["grad_norm"], ref["grad_norm"])
            assert not seen.keys() & c["example_losses"].keys(), f"{c['name']}: an example trained on two ranks"
            seen.update(c["example_losses"])
        assert seen.keys() == ref["examples"].keys(), f"{case['name']}: examples trained differ from the step's"
        assert any(len(shape) == 2 and shape[0] == 1 for shape in case["batch_shapes"])
        for key, loss in seen.items():
            diff = abs(loss - ref["examples"][key]) / scale(ref["examples"][key])
            worst["example"] = max(worst["example"], diff)
            assert diff <= example_tol, f"{case['name']}: example {key}: {loss} vs {ref['examples'][key]}"
    return worst


def test_packing_is_exact_on_two_nodes(checkpoints, tmp_path):
    """fp32, 2 nodes x 2, ep=2: packing with full fine-tuning and LoRA (attention and experts), padding-free with
    LoRA; 2 accumulation micro-batches; activation checkpointing; the global-batch aux loss (its value, and through
    the objective the gradient norm, against the model's own aux loss on the unpacked batch with padding masked).
    Several examples of 3 to 44 tokens per pack."""
    cases = "full-packing,lora-packing,lora-padding_free"
    result = launch("packing_parity.py", ["--ckpt", str(checkpoints / "qwen3_moe"), "--ep", "2", "--cases", cases,
                                          "--aux-coef", "0.5", "--out", str(tmp_path / "runs"), "--lower-level"],
                    tmp_path, nnodes=2,
                    nproc_per_node=2)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    # The lower-level loop (strategy.global_loss_tokens as num_items_in_batch): the starved rank 0 adds 0, not
    # NaN, and the summed shares are the global per-token mean of one process, gradient norm included.
    ref = ranks[0]["lower_level"]["ref"]
    assert ranks[0]["lower_level"]["share"] == 0.0
    for data in ranks.values():
        loop = data["lower_level"]
        assert loop["count"] == ref["count"]
        assert abs(loop["loss"] - ref["loss"]) <= FP32_TOLERANCE and abs(loop["grad_norm"] - ref["grad_norm"]) \
            <= FP32_TOLERANCE, (loop, ref)
    packs = [len(c["example_losses"]) for data in ranks.values() for c in data["cases"] if c["name"] == "lora-packing"]
    assert max(packs) >= 4, f"examples per rank {packs}: too few examples per pack to test anything"
    check_against_one_process(ranks, loss_tol=FP32_TOLERANCE, example_tol=FP32_TOLERANCE,
                              norm_tol=FP32_TOLERANCE, relative=False)


def test_packing_runs_in_bf16_on_two_nodes_of_four(checkpoints, tmp_path):
    result = launch("packing_parity.py", ["--ckpt", str(checkpoints / "qwen3_moe"), "--ep", "4", "--dtype", "bfloat16",
                                          "--accumulation", "1", "--cases", "lora-packing,full-padding_free",
                                          "--out", str(tmp_path / "runs")], tmp_path, nnodes=2, nproc_per_node=4,
                    timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == list(range(8))
    worst = check_against_one_process(ranks, loss_tol=BF16_LOSS, example_tol=BF16_EXAMPLE, norm_tol=BF16_NORM,
                                      relative=True)
    print("\nbf16 packing, largest relative differences: " + ", ".join(f"{k} {v / U:.2f} u" for k, v in worst.items()))


def test_a_family_that_cannot_be_packed_is_refused_on_every_rank(checkpoints, tmp_path):
    result = launch("packing_parity.py", ["--ckpt", str(checkpoints / "qwen3_next"), "--refuse",
                                          "--out", str(tmp_path / "runs")], tmp_path, nnodes=2, nproc_per_node=2,
                    timeout=300)
    assert not result.timed_out, result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for data in ranks.values():
        assert data["ok"] is False and data["error_type"] == "PackingError", data
        assert data["error"].startswith("data.packing / data.padding_free cannot train qwen3_next: its layers of "
                                        "type ['linear_attention']"), data["error"]
