"""Generation and routing replay on simulated nodes (tests/workers/rl_moe.py), against one process.

Two launches: 2 nodes x 2 at ep=2 (generation, replay with activation checkpointing, padding, packing and
sp=2, refusals, the bf16 rollout/trainer measurement) and 1 node x 4 at ep=4 (generation).
Generation: each rank has its own number of prompts (rank 3 none) and lengths, left-padded, its own
max_new_tokens and a stop token its first prompt reaches at its own step; the tokens equal the same model
generating the same prompts in one process (fp32 greedy and sampled with the same seed, LoRA on attention
and experts; greedy fp32 of gpt-oss, Mixtral and Qwen3-MoE with a sliding window of 4 tokens). bf16 generation
runs to the same stops; its equality with one process is reported, not
asserted: EP sums bf16 expert outputs of other matmul shapes (rounding, see tests/multiproc/test_bf16.py).
"""

from __future__ import annotations

import json

import pytest
from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

TOLERANCE = 1e-5
SLIDING_WINDOW = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_ckpts")
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe"), seed=0)
    # MLA attends with every head for keys (its tiny default of 2 KV heads breaks any attention mask).
    save_tiny_checkpoint("deepseek_v3", str(root / "deepseek_v3"), seed=0, num_key_value_heads=4)
    # Sliding-window attention with a window of 4 tokens, shorter than most prompts (rl_moe.SLIDING_WINDOW_CHECKPOINTS).
    save_tiny_checkpoint("gpt_oss", str(root / "gpt_oss_sw4"), seed=0, sliding_window=SLIDING_WINDOW)
    save_tiny_checkpoint("mixtral", str(root / "mixtral_sw4"), seed=0, sliding_window=SLIDING_WINDOW)
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe_sw4"), seed=0, use_sliding_window=True,
                         sliding_window=SLIDING_WINDOW)
    return root


@pytest.fixture(scope="module")
def two_by_two(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_2x2")
    result = launch("rl_moe.py", ["--ckpt-root", str(checkpoints), "--ep", "2", "--generate", "--replay", "--sp",
                                  "--measure"], out, nnodes=2, nproc_per_node=2, timeout=600)
    assert result.ok(), result.describe()
    return result.rank_results()


@pytest.fixture(scope="module")
def one_by_four(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_1x4")
    result = launch("rl_moe.py", ["--ckpt-root", str(checkpoints), "--ep", "4", "--generate"], out, nnodes=1,
                    nproc_per_node=4, timeout=600)
    assert result.ok(), result.describe()
    return result.rank_results()


@pytest.mark.parametrize("shape", ["two_by_two", "one_by_four"])
def test_generation_under_ep_equals_one_process(shape, request):
    ranks = request.getfixturevalue(shape)
    assert sorted(ranks) == [0, 1, 2, 3] and all(r["ok"] for r in ranks.values())
    stops = {}
    for rank, result in ranks.items():
        for case in result["generation"]:
            where = f"rank {rank} {case['family']} {case['dtype']} lora={case['lora']} sampled={case['sampled']}"
            if case["dtype"] == "torch.float32":
                assert case["same"], f"{where}: {case['got']} != {case['expected']}"
            if case["prompts"] == 0:  # the rank without a prompt took part and returned nothing
                assert rank == 3 and case["got"] == [] and case["record_shape"][0] == 0, where
                continue
            rows, length = len(case["got"]), len(case["got"][0])
            assert case["record_shape"][:2] == [rows, length] and case["record_tail_unrecorded"], where
            if not case["sampled"] and not case["lora"] and case["dtype"] == "torch.float32":
                stops.setdefault(case["family"], set()).add(case["stop_step"])
    # The stop tokens were hit at different steps on different ranks.
    assert all(len(steps - {None}) >= 2 for steps in stops.values()), stops


@pytest.mark.parametrize("shape", ["two_by_two", "one_by_four"])
def test_generation_with_sliding_window_caches_equals_one_process(shape, request):
    """gpt-oss (sliding and full layers alternating), Mixtral and Qwen3-MoE (use_sliding_window: every layer), window
    4: prompts longer than the window and generation past it, so transformers' sliding-window cache layers drop keys
    in prefill and decoding; greedy fp32 under FSDP2 + EP equals one process."""
    seen = {}
    for rank, result in request.getfixturevalue(shape).items():
        for case in result["generation"]:
            if not case["family"].endswith("_sw4"):
                continue
            assert case["sliding_window"] == SLIDING_WINDOW and case["dtype"] == "torch.float32", case
            assert case["same"], f"rank {rank} {case['family']}: {case['got']} != {case['expected']}"
            seen.setdefault(case["family"], []).append(len(case["got"][0]) if case["got"] else 0)
    assert sorted(seen) == ["gpt_oss_sw4", "mixtral_sw4", "qwen3_moe_sw4"], seen
    # Ranks 0 and 2 (prompts of 6 and 7 tokens) end well past the window; rank 3 has no prompt.
    assert all(max(lengths) > 3 * SLIDING_WINDOW for lengths in seen.values()), seen


def test_replay_of_the_trainers_own_record_changes_nothing(two_by_two):
    """R3 with the record of the trainer's own forward, ep=2, activation checkpointing: padded rows (padding not
    recorded) and packed rows."""
    for rank, result in two_by_two.items():
        for family, cases in result["replay"].items():
            for kind in ("padded", "packed"):
                case = cases[kind]
                assert max(case["logit_diff"], case["loss_diff"], case["grad_diff"]) <= TOLERANCE, (rank, family, kind)
                assert case["agreement"] == [1.0] * len(case["agreement"]), (rank, family, kind)


def test_replay_under_sequence_parallelism_cuts_the_record_with_the_tokens(two_by_two):
    """sp=2, ep=2: the record of the whole rows (one process), cut by split_sequence, replayed on each chunk."""
    for result in two_by_two.values():
        sp = result["sp"]
        assert max(sp["logit_diff"], sp["loss_diff"], sp["grad_diff"]) <= TOLERANCE and sp["chunk_tokens"] == 7
        # A record cut elsewhere than the tokens would be compared with other tokens' choices.
        assert sp["agreement"] == [1.0, 1.0], sp


def test_a_forced_record_is_dispatched_and_the_router_gradient_equals_one_process(two_by_two):
    for rank, result in two_by_two.items():
        for family, cases in result["replay"].items():
            forced = cases["forced"]
            assert forced["load_equal"], (rank, family, forced["load"])  # every layer's experts got the record's tokens
            assert forced["routers"] == {"qwen3_moe": 2, "deepseek_v3": 1}[family]
            assert forced["router_grad_norm"] > 1e-3 and forced["router_grad_diff"] <= TOLERANCE, (rank, family)
            assert max(forced["agreement"]) < 0.5  # the telemetry sees a record that is not the router's choice
            starved = cases["starved"]  # every token on EP rank 0's experts: rank 1's experts receive none
            assert starved["counts_equal"] and starved["loss"] > 0, (rank, family, starved)


def test_a_record_that_does_not_fit_on_one_rank_is_refused_on_every_rank(two_by_two):
    for result in two_by_two.values():
        for family, cases in result["replay"].items():
            layers = {"qwen3_moe": 2, "deepseek_v3": 1}[family]
            assert cases["refusal"] == (
                f"routing replay failed on rank(s) [1]: rank 1: routed_experts has shape [2, 11, {layers}, 2] but "
                f"input_ids [2, 12] on a model with {layers} MoE layers and top_k=2 needs [2, 12, {layers}, 2] (one "
                "entry per token, MoE layer and choice; -1 for tokens without a record)")


def test_generation_is_refused_under_sequence_parallelism_on_every_rank(two_by_two):
    for result in two_by_two.values():
        assert result["sp"]["generate_refusal"].startswith(
            "ParallelConfigError: generate does not run under sequence parallelism (sequence_parallel_size=2)")


def test_replay_closes_the_bf16_rollout_trainer_mismatch(two_by_two, tmp_path_factory):
    """bf16: sampled rollouts by generate (KV cache, one token a step) and the training forward over the same
    sequences route some tokens differently; under R3 the trainer routes every token as the rollout did and its
    logprobs come closer to the rollout's."""
    summary = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        cases = [c for r in two_by_two.values() for c in r["measure"] if c["family"] == family]
        assert all(c["r3_routing_equal"] for c in cases)
        tokens = sum(c["tokens"] for c in cases)
        summary[family] = {
            "tokens": tokens,
            "tokens_routed_differently_in_some_layer": sum(c["tokens_differing_in_some_layer"] * c["tokens"]
                                                           for c in cases) / tokens,
            "logprob_gap_without_replay": sum(c["no_replay_logprob_gap"] for c in cases) / len(cases),
            "logprob_gap_with_r3": sum(c["r3_logprob_gap"] for c in cases) / len(cases),
        }
    print("bf16 rollout vs trainer (2x2 ep=2):", json.dumps(summary))
    # (Near-ties are rare in tiny models: over both families some tokens must differ; where none did, the gap stays.)
    assert sum(s["tokens_routed_differently_in_some_layer"] for s in summary.values()) > 0, summary
    assert all(s["logprob_gap_with_r3"] <= s["logprob_gap_without_replay"] for s in summary.values()), summary
    assert sum(s["logprob_gap_with_r3"] for s in summary.values()) < sum(
        s["logprob_gap_without_replay"] for s in summary.values()), summary
