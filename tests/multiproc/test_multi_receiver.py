"""A source with several receivers (1 node x 4, ep=4): exact weights, bounded source memory, portable
collectives, and a read fault on the source that ends every rank quickly with the same named error."""

import math
import shutil

from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

BUCKET = 13312  # small: each receiver gets 4 or 5 buckets (rank 3 keeps 3 rows of each embedding less)
STAGED_BUCKETS = 4  # the source's bound beyond its shards
TIMEOUT_S = 120  # the strategy's collective timeout in the worker; a fault must end far sooner


def test_one_source_several_receivers(tmp_path):
    ckpt = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "ckpt"), seed=3, vocab_size=1001, hidden_size=16, num_layers=3)
    faulty = tmp_path / "faulty"
    shutil.copytree(ckpt, faulty)
    result = launch("multi_receiver.py", ["--ckpt", ckpt, "--faulty-ckpt", str(faulty),
                                          "--bucket-bytes", str(BUCKET)],
                    tmp_path / "out", nnodes=1, nproc_per_node=4, timeout=400)
    assert not result.timed_out, result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for kind_index, kind in enumerate(("p2p", "scatter")):
        cases = {rank: data["cases"][kind_index] for rank, data in ranks.items()}
        for rank, case in cases.items():
            assert case["kind"] == kind
            assert case["mismatches"] == [], f"{kind} rank {rank}: gathered weights differ from the checkpoint"
        source = cases[0]
        # Bounded: the source holds at most 4 buckets beyond its shards while it sends to 3 receivers.
        limit = STAGED_BUCKETS * (BUCKET + 1)
        assert 0 < source["extra_peak"] <= limit, f"{kind}: source held {source['extra_peak']} > {limit} bytes"
        receivers = [cases[r]["report"] for r in (1, 2, 3)]
        for report in receivers:  # exactly its shards with p2p; scatter pads the shorter streams
            kept = report["shard_bytes"] + report["buffer_bytes"]
            assert report["bytes_received"] == kept if kind == "p2p" else report["bytes_received"] >= kept
        if kind == "p2p":
            counts = [r["buckets"] for r in receivers]
            assert counts == [math.ceil(r["bytes_received"] / BUCKET) for r in receivers]
            assert len(set(counts)) > 1 and min(counts) > 1, f"receivers should get different bucket counts: {counts}"
            assert source["report"]["buckets"] == sum(counts)
    for rank, data in ranks.items():
        spy = data["spy"]
        # Every tensor a collective touched was on the backend's device, and no object collective ran.
        assert spy["object_calls"] == [], f"rank {rank}: object collectives in the init path: {spy['object_calls']}"
        assert spy["devices"] == [data["cases"][0]["backend_device"]], f"rank {rank}: {spy['devices']}"
        for name in ("all_gather", "broadcast", "all_reduce", "batch_isend_irecv", "scatter"):
            assert spy["calls"].get(name, 0) > 0, f"rank {rank}: {name} never ran: {spy['calls']}"
        # The truncated file: the source's read thread fails; every rank names it, long before the timeout.
        assert data["ok"] is False and data["error_type"] == "DistributedInitError", data.get("error")
        assert "memory_efficient_init failed on rank(s) [0]: rank 0: CheckpointError: checkpoint file" \
               in data["error"] and "truncated after the run started" in data["error"], data["error"]
        assert data["fault_ended"] - data["fault_started"] < 30, f"rank {rank} took too long to fail"
    assert all(rc != 0 for rc in result.returncodes)
