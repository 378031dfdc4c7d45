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

import pytest
from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

U = 2.0 ** -8
FP32_TOLERANCE = 1e-5
BF16_LOSS, BF16_EXAMPLE, BF16_NORM = U, 2 * U, 8 * U


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
