"""The smoke subset: exact init, one bf16 parity case, save and resume, activation checkpointing, in one launch.

A fast check of the versions a user may install: `.ci/run` runs it in a virtualenv with the oldest versions
setup.py allows (scripts/oldest_env.sh), `scripts/check_latest.sh` with the newest releases, and the full suite
runs it on the pinned set. One launch (2 simulated nodes x 2 ranks, ep=2; tests/workers/smoke.py) runs the four
parts; each test below checks one of them, as the full tests check it (fewer families and cases).
"""

import pytest
import torch
from multinode import REPO, launch
from test_bf16 import check_cases
from test_bf16 import save_checkpoint as save_bf16_checkpoint
from test_long_runs import assert_recomputation_replays_the_dispatch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint
from twinkle_strategy.train.demo_model import prepare_demo_model

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    # The demo Qwen3-MoE in several files; Mixtral's per-expert keys (w1/w2/w3) in several files.
    model = prepare_demo_model(str(root / "demo"), DATASET, max_shard_size="200KB")
    save_tiny_checkpoint("mixtral", str(root / "mixtral_sharded"), seed=2, max_shard_size="40KB")
    save_bf16_checkpoint("deepseek_v3", str(root / "deepseek_v3"))
    result = launch("smoke.py", ["--model", model, "--dataset", DATASET, "--init-checkpoints",
                                 str(root / "mixtral_sharded"), "--bf16-checkpoint", str(root / "deepseek_v3"),
                                 "--output-dir", str(root / "out")],
                    root / "launch", nnodes=2, nproc_per_node=2, timeout=900)
    ranks = result.rank_results()
    assert not result.timed_out and sorted(ranks) == [0, 1, 2, 3], result.describe()
    print(f"\nsmoke launch: {result.seconds:.1f} s on {ranks[0]['versions']}; parts: "
          + ", ".join(f"{part} {ranks[0][part]['seconds']:.1f} s" for part in PARTS if part in ranks[0]))
    return result, ranks


PARTS = ("init", "bf16", "save_resume", "checkpointing")
PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def part(smoke, name: str) -> dict:
    """Each rank's result of one part; the part's error (first rank's traceback), or the launch's logs."""
    result, ranks = smoke
    errors = {rank: data[name] for rank, data in ranks.items() if "error" in data.get(name, {})}
    if errors:
        # The traceback of a rank that raised on its own, not of one whose peer closed the connection.
        own = [rank for rank, e in errors.items() if not any(text in e["error"] for text in PEER_GONE)]
        shown = min(own or errors)
        summary = "\n".join(f"rank {rank}: {e['error'][:300]}" for rank, e in sorted(errors.items()))
        raise AssertionError(f"{name} failed on rank(s) {sorted(errors)}:\n{summary}\nrank {shown}:\n"
                             f"{errors[shown]['traceback']}")
    missing = [rank for rank, data in ranks.items() if name not in data]
    assert not missing, f"{name}: no result from rank(s) {missing}\n{result.describe()}"
    return {rank: data[name]["result"] for rank, data in ranks.items()}


def test_memory_efficient_init_is_exact(smoke):
    for rank, cases in part(smoke, "init").items():
        assert len(cases) == 2
        for c in cases:
            case = f"rank {rank} {c['path']}"
            assert c["state_mismatches"] == [], f"{case}: weights differ from from_pretrained"
            assert c["buffer_mismatches"] == [], f"{case}: buffers differ from from_pretrained"
            assert c["own_experts_ok"] and c["expert_params"] > 0, f"{case}: local experts are not this rank's"
            report = c["report"]
            assert report["is_source"] == (rank % 2 == 0), case
            if report["is_source"]:
                assert report["bytes_read"] > 0 and report["bytes_received"] == 0, (case, report)
            else:  # streamed from the node's source: nothing read, exactly its shard received
                assert report["bytes_read"] == 0, (case, report)
                assert report["bytes_received"] == report["shard_bytes"] + report["buffer_bytes"] > 0, (case, report)


def test_bf16_matches_one_process(smoke):
    ranks = {rank: {"cases": [c]} for rank, c in part(smoke, "bf16").items()}
    check_cases(ranks, ["deepseek_v3:full"])
    assert ranks[0]["cases"][0]["kept"], "transformers keeps no tensor in fp32: the case tests nothing"


def test_save_and_resume_continue_with_the_same_losses(smoke):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    runs = part(smoke, "save_resume")
    first, resumed = runs[0]["first"], runs[0]["resumed"]
    assert resumed["start_step"] == 2 and sorted(resumed["losses"]) == ["3", "4"], resumed
    for step in ("3", "4"):
        assert abs(resumed["losses"][step] - first["losses"][step]) <= 1e-5, (step, first, resumed)
    # The checkpoint is a plain Hugging Face checkpoint of the trained model, written without a gather.
    run_dir = Path(runs[0]["run_dir"])
    model, info = AutoModelForCausalLM.from_pretrained(str(run_dir / "checkpoint-2"), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    gathered = torch.load(run_dir / "gathered-2.pt", weights_only=True)
    assert sorted(model.state_dict()) == sorted(gathered)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, gathered[k])] == []
    assert len(list((run_dir / "checkpoint-2").glob("*.safetensors"))) > 1
    for rank, data in runs.items():
        report = data["first"]["save_reports"]["2"]
        assert report["bytes_received"] == 0 and report["gathered"] == [], (rank, report)


def test_activation_checkpointing_changes_nothing(smoke):
    for rank, data in part(smoke, "checkpointing").items():
        plain, checkpointed = data["gc0"]["steps"], data["gc1"]["steps"]
        assert len(plain) == len(checkpointed) == 2
        for a, b in zip(plain, checkpointed, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), (rank, plain, checkpointed)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-6), (rank, plain, checkpointed)
            assert b["counts"] == a["counts"]  # tokens counted once, not again in the recomputation
            assert_recomputation_replays_the_dispatch(rank, a, b, expert_lora=True)
