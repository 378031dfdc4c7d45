"""Expert parallelism + FSDP2 across simulated nodes, checked against a single-process run."""

from launches import assert_every_rank_reached_the_fatal_case
from multinode import launch

from twinkle_strategy.testing.families import FAMILIES


def test_ep_fsdp_matches_single_process(tiny_checkpoints, tmp_path):
    """2 nodes x 2 ranks, ep=2 (ep_fsdp=2) and ep=4 (ep_fsdp=1), all four families."""
    result = launch("ep_parity.py", ["--ckpt-root", str(tiny_checkpoints)], tmp_path, nnodes=2,
                    nproc_per_node=2, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        seen = {(c["family"], c["ep"]) for c in data["cases"]}
        assert seen == {(f, ep) for f in FAMILIES for ep in (2, 4)}
        for c in data["cases"]:
            case = f"rank {rank} {c['family']} ep={c['ep']}"
            assert c["init_diff"] == 0.0, f"{case}: weights after wrapping differ from the checkpoint at {c['init_where']}"
            assert c["own_experts_ok"], f"{case}: local expert tensors are not this rank's experts"
            assert c["logit_diff"] <= 1e-5, f"{case}: logits differ by {c['logit_diff']}"
            assert c["loss_diff"] <= 1e-4, f"{case}: losses {c['losses']} vs {c['ref_losses']}"
            # Clipping was active (norm above max_norm) and the EP-aware norm equals the reference norm.
            assert min(c["ref_norms"]) > 0.5
            assert c["norm_diff"] <= 1e-4 * max(c["ref_norms"]), f"{case}: grad norms {c['norms']} vs {c['ref_norms']}"
            assert c["final_diff"] <= 1e-5, f"{case}: weights after 3 steps differ by {c['final_diff']} at {c['final_where']}"


def test_invalid_sizes_fail_on_every_rank(refusals):
    # (rides the refusals launch, tests/launches.py: its last case, ep_not_dividing_world, is left uncaught)
    ranks = assert_every_rank_reached_the_fatal_case(refusals)
    expected = {
        "ep_not_dividing_world": ("ParallelConfigError", "world size 4 is not divisible by ep_size 3; choose ep_size among [1, 2, 4]"),
        "ep_fsdp_mismatch": ("ParallelConfigError", "ep_fsdp_size 4 * ep_size 2 must equal the world size 4; use ep_fsdp_size=2"),
        "experts_not_divisible": ("ParallelConfigError", "model.layers.0.mlp.experts has 6 experts, not divisible by ep_size 4; choose ep_size among [1, 2]"),
        "dense_model_with_ep": ("ModelStructureError", "ep_size=2 but Qwen3ForCausalLM (model_type 'qwen3') has no MoE block"),
    }
    for rank, data in ranks.items():
        # The fatal case ends every rank with the error it raised.
        assert data["ok"] is False and data["error_type"] == "ParallelConfigError", data
        for name, (etype, text) in expected.items():
            err = data["errors"][name]
            assert err is not None, f"rank {rank}: {name} raised nothing"
            assert err["type"] == etype and text in err["message"], f"rank {rank}: {name}: {err}"


def test_uneven_nodes_fail_on_every_rank(tmp_path):
    """Node 0 runs 2 processes, node 1 runs 1: every rank names the mismatch and exits."""
    result = launch("bad_config.py", ["--cases", "plain_setup", "--fatal", "plain_setup"], tmp_path,
                    nnodes=2, nproc_per_node=[2, 1], timeout=300)
    assert not result.timed_out, result.describe()
    assert all(rc != 0 for rc in result.returncodes), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2]
    for data in ranks.values():
        assert data["error_type"] == "TopologyError", data
        assert "LOCAL_WORLD_SIZE differs between nodes (node 0: 2, node 1: 1)" in data["error"], data
