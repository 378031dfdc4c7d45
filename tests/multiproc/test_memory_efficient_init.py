"""memory_efficient_init across simulated nodes: exact weights, own experts, only the bytes each rank keeps.

Sources stream the checkpoint (hub layout, single file and sharded): each reads from the files only its
node's rows; every other rank opens no weight file and receives exactly its shard and buffers.
"""

import math

from conftest import LAYOUT_CHECKPOINTS
from launches import HUB_MISSING_KEY as MISSING_KEY
from launches import HUB_TRUNCATED_KEY as TRUNCATED_KEY
from launches import HUB_WRONG_KEY as WRONG_KEY
from launches import assert_every_rank_reached_the_fatal_case
from multinode import launch

from twinkle_strategy.testing.families import FAMILIES

BUCKET = 4096


def check_base_cases(ranks: dict, nproc_per_node: int, expected_cases: set):
    for rank, data in ranks.items():
        assert {(c["family"], c["ep"]) for c in data["cases"]} == expected_cases
        is_source = rank % nproc_per_node == 0
        for c in data["cases"]:
            case = f"rank {rank} {c['family']} ep={c['ep']}"
            report = c["report"]
            assert report["is_source"] == is_source
            assert c["state_mismatches"] == [], f"{case}: gathered weights differ from the checkpoint"
            assert c["buffer_mismatches"] == [], f"{case}: buffers (RoPE inv_freq ...) differ from the reference"
            assert c["own_experts_ok"], f"{case}: local experts are not this rank's experts"
            assert c["logit_diff_vs_plain"] <= 1e-5, f"{case}: logits differ from memory_efficient_init=False"
            if c["tied"]:
                assert c["tied_ok"], f"{case}: lm_head and embed_tokens are no longer one tensor"
            # Transfers grow with bytes / bucket size: one per bucket (+ 3 control collectives: needs, go, done);
            # the source sends each bucket on its own (staged through a fixed pool of buffers).
            node = range(rank - rank % nproc_per_node, rank - rank % nproc_per_node + nproc_per_node)
            index = data["cases"].index(c)
            receivers = [ranks[r]["cases"][index]["report"] for r in node if r % nproc_per_node]
            if is_source:
                assert report["buckets"] == sum(r["buckets"] for r in receivers), f"{case}: {report}"
                assert report["collective_calls"] == report["buckets"] + 3, f"{case}: {report}"
            else:
                kept = report["shard_bytes"] + report["buffer_bytes"]
                assert report["buckets"] == math.ceil(kept / BUCKET), f"{case}: {report}"
                assert report["collective_calls"] == report["buckets"] + 3, f"{case}: {report}"
            node_reports = [ranks[r]["cases"][index]["report"] for r in node]
            node_share = sum(r["shard_bytes"] for r in node_reports)
            if is_source:
                assert report["bytes_received"] == 0
                assert report["bytes_sent"] > 0
                # Streamed: the source read its node's rows and nothing else (buffers once, for the node).
                assert node_share <= report["bytes_read"] <= 1.05 * node_share + report["buffer_bytes"], \
                    f"{case}: read {report['bytes_read']} bytes for a node share of {node_share}"
                assert report["whole_tensors"] == [], f"{case}: read whole: {report['whole_tensors']}"
                assert c["opened_weight_files"] and all(f.endswith(tuple(c["weight_files"]))
                                                        for f in c["opened_weight_files"])
            else:
                assert report["bytes_read"] == 0 and c["opened_weight_files"] == [], \
                    f"{case}: a non-source rank read {c['opened_weight_files']}"
                kept = report["shard_bytes"] + report["buffer_bytes"]
                assert report["bytes_sent"] == 0
                assert report["bytes_received"] == kept, \
                    f"{case}: received {report['bytes_received']} bytes for a shard of {report['shard_bytes']}"
                # Never a full tensor on a non-source rank, and no allocation above a bucket or a local shard.
                assert c["full_shaped_allocations"] == [], f"{case}: {c['full_shaped_allocations']}"
                # (the config from the source, and this rank's plan for it, are pickled messages: metadata)
                assert c["largest_allocation"] <= max(BUCKET, c["largest_local"], c["largest_buffer"],
                                                      1.1 * c["config_bytes"], 1.1 * c["plan_bytes"]), case
            if is_source:
                # The source reads a bucket's worth of rows at a time (at least one row: an expert), never a
                # whole tensor of which its node keeps a part.
                limit = max(BUCKET, c["largest_local"], c["largest_buffer"], c["largest_row"],
                            1.1 * c["node_plan_bytes"], 1.1 * c["config_bytes"])
                assert c["largest_allocation"] <= limit, f"{case}: {c['largest_allocation']} > {limit}"


def test_two_nodes_all_families_lora_and_bad_checkpoint(tiny_checkpoints, wrong_shape_checkpoint, tmp_path):
    """2 nodes x 2 ranks, ep=2 (ep_fsdp=2) and ep=4; LoRA fresh and loaded; a wrong-shaped checkpoint."""
    families = list(FAMILIES) + ["qwen3_moe_tied"] + list(LAYOUT_CHECKPOINTS)
    result = launch("mem_init.py", ["--ckpt-root", str(tiny_checkpoints), "--families", ",".join(families),
                                    "--ep-sizes", "2,4", "--bucket-bytes", str(BUCKET), "--lora",
                                    "--also-in-memory", "--bad-ckpt", str(wrong_shape_checkpoint)],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=600)
    assert not result.timed_out, result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    check_base_cases(ranks, 2, {(f, ep) for f in families for ep in (2, 4)})
    for rank, data in ranks.items():
        assert [c["mode"] for c in data["lora"]] == ["fresh", "loaded"]
        for c in data["lora"]:
            assert c["expert_lora_keys"] > 0 and c["lora_keys"] > c["expert_lora_keys"]
            assert c["mismatches"] == [], f"rank {rank} LoRA {c['mode']}: adapter differs from single process"
            assert c["logit_diff"] <= 1e-5, f"rank {rank} LoRA {c['mode']}: logits differ by {c['logit_diff']}"
        # The source's model in host memory: loaded whole (nothing read in wrap_model), or with a new head the
        # user built (sent from memory) while the rest streams.
        whole, new_head = data["in_memory"]["whole"], data["in_memory"]["new_head"]
        assert whole["mismatches"] == [] and whole["report"]["bytes_read"] == 0, whole
        assert new_head["mismatches"] == [], new_head
        if rank % 2 == 0:
            assert new_head["report"]["bytes_read"] > 0
        # The wrong-shaped checkpoint: every rank raises, naming the tensor, and exits.
        assert data["ok"] is False and data["error_type"] == "DistributedInitError", data.get("error")
        assert "tensor 'model.layers.1.mlp.gate.weight' has shape (3, 3) in the checkpoint but the model " \
               "expects (8, 32)" in data["error"]
        assert "rank(s) [0, 2]" in data["error"]  # both sources read it; both are named
    assert all(rc != 0 for rc in result.returncodes)


def test_three_nodes(tiny_checkpoints, tmp_path):
    """3 nodes x 2 ranks, ep=2 (ep_fsdp=3): FSDP shards that do not divide evenly."""
    families = list(FAMILIES) + list(LAYOUT_CHECKPOINTS)
    result = launch("mem_init.py", ["--ckpt-root", str(tiny_checkpoints), "--ep-sizes", "2",
                                    "--families", ",".join(families), "--bucket-bytes", str(BUCKET),
                                    "--also-scatter"],
                    tmp_path, nnodes=3, nproc_per_node=2, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == list(range(6))
    check_base_cases(ranks, 2, {(f, 2) for f in families})
    for rank, data in ranks.items():
        # The collective (scatter) transport fills identical weights, padding the shorter streams.
        scatter = data["scatter"]
        assert scatter["mismatches_vs_p2p"] == [], f"rank {rank}: scatter and p2p transports differ"
        if rank % 2:
            assert scatter["bytes_received"] >= scatter["kept"]


def test_bad_hub_checkpoints_are_named_by_key_on_every_rank(refusals):
    """A wrong-shaped per-expert tensor, a missing one, a truncated shard: named by checkpoint key, before any
    weight is read, on every rank; nobody hangs. (Rides the refusals launch, tests/launches.py.)"""
    ranks = assert_every_rank_reached_the_fatal_case(refusals)
    expected = {
        "hub_wrong_shape": [f"checkpoint tensor '{WRONG_KEY}' has shape (64, 16)",
                            "model parameter 'model.layers.1.mlp.experts.down_proj' (8, 32, 16) have (32, 16)"],
        "hub_missing_key": [f"model parameter 'model.layers.0.mlp.experts.gate_up_proj' (8, 32, 32) needs "
                            f"checkpoint tensor(s) '{MISSING_KEY}', which are missing"],
        "hub_truncated": ["is truncated", f"'{TRUNCATED_KEY}'"],
    }
    for rank, data in ranks.items():
        for case, texts in expected.items():
            err = data["errors"][case]
            assert err is not None and err["type"] == "DistributedInitError", (rank, case, err)
            for text in texts:
                assert text in err["message"], (rank, case, err["message"])
            assert "rank(s) [0, 2]" in err["message"]  # both nodes' sources found it, from the headers
