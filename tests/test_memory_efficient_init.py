"""memory_efficient_init across simulated nodes: exact weights, own experts, only the bytes each rank keeps."""

import math

from multinode import launch
from twinkle_strategy.tiny_models import FAMILIES

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
            # Transfers grow with bytes / bucket size: one per bucket (+ 3 control collectives: needs, go, done).
            node = range(rank - rank % nproc_per_node, rank - rank % nproc_per_node + nproc_per_node)
            index = data["cases"].index(c)
            receivers = [ranks[r]["cases"][index]["report"] for r in node if r % nproc_per_node]
            if is_source:
                assert report["buckets"] == sum(r["buckets"] for r in receivers), f"{case}: {report}"
                assert report["collective_calls"] == max(r["buckets"] for r in receivers) + 3, f"{case}: {report}"
            else:
                kept = report["shard_bytes"] + report["buffer_bytes"]
                assert report["buckets"] == math.ceil(kept / BUCKET), f"{case}: {report}"
                assert report["collective_calls"] == report["buckets"] + 3, f"{case}: {report}"
            if is_source:
                assert report["bytes_received"] == 0
                assert report["bytes_sent"] > 0
            else:
                kept = report["shard_bytes"] + report["buffer_bytes"]
                assert report["bytes_sent"] == 0
                assert kept <= report["bytes_received"] <= 1.05 * report["shard_bytes"] + report["buffer_bytes"], \
                    f"{case}: received {report['bytes_received']} bytes for a shard of {report['shard_bytes']}"
                # Never a full tensor on a non-source rank, and no allocation above a bucket or a local shard.
                assert c["full_shaped_allocations"] == [], f"{case}: {c['full_shaped_allocations']}"
                assert c["largest_allocation"] <= max(BUCKET, c["largest_local"], c["largest_buffer"]), case


def test_two_nodes_all_families_lora_and_bad_checkpoint(tiny_checkpoints, wrong_shape_checkpoint, tmp_path):
    """2 nodes x 2 ranks, ep=2 (ep_fsdp=2) and ep=4; LoRA fresh and loaded; a wrong-shaped checkpoint."""
    families = list(FAMILIES) + ["qwen3_moe_tied"]
    result = launch("mem_init.py", ["--ckpt-root", str(tiny_checkpoints), "--families", ",".join(families),
                                    "--ep-sizes", "2,4", "--bucket-bytes", str(BUCKET), "--lora",
                                    "--bad-ckpt", str(wrong_shape_checkpoint)],
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
        # The wrong-shaped checkpoint: every rank raises, naming the tensor, and exits.
        assert data["ok"] is False and data["error_type"] == "DistributedInitError", data.get("error")
        assert "tensor 'model.layers.1.mlp.gate.weight' has shape (3, 3) in the checkpoint but the model " \
               "expects (8, 32)" in data["error"]
        assert "rank(s) [0, 2]" in data["error"]  # both sources read it; both are named
    assert all(rc != 0 for rc in result.returncodes)


def test_three_nodes(tiny_checkpoints, tmp_path):
    """3 nodes x 2 ranks, ep=2 (ep_fsdp=3): FSDP shards that do not divide evenly."""
    result = launch("mem_init.py", ["--ckpt-root", str(tiny_checkpoints), "--ep-sizes", "2",
                                    "--bucket-bytes", str(BUCKET), "--also-scatter"],
                    tmp_path, nnodes=3, nproc_per_node=2, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == list(range(6))
    check_base_cases(ranks, 2, {(f, 2) for f in FAMILIES})
    for rank, data in ranks.items():
        # The collective (scatter) transport fills identical weights, padding the shorter streams.
        scatter = data["scatter"]
        assert scatter["mismatches_vs_p2p"] == [], f"rank {rank}: scatter and p2p transports differ"
        if rank % 2:
            assert scatter["bytes_received"] >= scatter["kept"]
