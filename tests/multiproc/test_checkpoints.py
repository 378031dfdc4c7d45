"""Full-parameter checkpoints written without a rank-0 gather, and resumed on other layouts.

One run (2 simulated nodes x 2 ranks, ep=2, memory_efficient_init, fp32) trains 5 steps and saves
at step 3 and 5. The checkpoint must be a plain Hugging Face checkpoint in the source checkpoint's
key layout, equal to the trained model, written with no rank receiving more than its shard. Runs
resumed from step 3 on 1 node x 2 ranks (per-device batch doubled: the same global batch) and on
2 nodes x 4 with ep=4 (per-device batch halved) must log the uninterrupted run's losses for steps 4
and 5, and save a checkpoint of what they trained.
"""

import json

import pytest
import torch
from multinode import REPO, launch

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
BUCKET = 1 << 20
LIMIT = 600


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A ~30 MB Qwen3-MoE in the hub layout (per-expert keys), in several files, with the demo tokenizer."""
    from twinkle_strategy.train.demo_model import prepare_demo_model

    return prepare_demo_model(str(tmp_path_factory.mktemp("ckpt") / "model"), DATASET, hidden_size=256,
                              intermediate_size=256, num_layers=4, max_shard_size="8MB")


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = launch("save_resume.py", ["--model", model_dir, "--dataset", DATASET, "--output-dir", str(out / "out"),
                                       "--per-device", "2", "--max-steps", "5", "--save-steps", "3",
                                       "--bucket-bytes", str(BUCKET), "--max-shard-size", "4MB"],
                    out / "logs", nnodes=2, nproc_per_node=2, timeout=LIMIT)
    assert result.ok(), result.describe()
    return out / "out", result.rank_results()


def test_saved_checkpoint_is_a_plain_hf_checkpoint_of_the_trained_model(model_dir, uninterrupted):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

    out, ranks = uninterrupted
    checkpoint = out / "checkpoint-3"
    model, info = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    gathered = torch.load(out / "gathered-3.pt", weights_only=True)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(gathered)
    assert [k for k in gathered if not torch.equal(loaded[k], gathered[k])] == []
    # The source checkpoint's own key layout (per-expert keys), nothing more, nothing less.
    saved, source = SafetensorsIndex.from_directory(str(checkpoint)), SafetensorsIndex.from_directory(model_dir)
    assert set(saved.tensors) == set(source.tensors)
    assert any(".experts.3.gate_proj.weight" in k for k in saved.tensors)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several files, as max_shard_size asks
    for name in set(index["weight_map"].values()):
        with safe_open(str(checkpoint / name), "pt") as f:  # the safetensors library reads every file
            assert f.keys()
    # Nothing was gathered to write it: every rank wrote its own rows and received nothing.
    for data in ranks.values():
        report = data["save_reports"]["3"]
        assert report["bytes_received"] == 0 and report["gathered"] == [], report
        assert report["bytes_written"] >= report["shard_bytes"] > 0, report
    assert sum(data["save_reports"]["3"]["bytes_written"] for data in ranks.values()) >= \
        sum(source.tensors[k].nbytes for k in source.tensors)


def test_save_holds_no_more_than_its_shard(uninterrupted):
    _, ranks = uninterrupted
    for rank, data in ranks.items():
        for step, report in data["save_reports"].items():
            growth = report["peak_rss_bytes"] - report["rss_before_bytes"]
            assert growth <= report["shard_bytes"] + 2 * BUCKET, \
                f"rank {rank} step {step}: peak RSS grew by {growth} bytes during the save, its shard is " \
                f"{report['shard_bytes']}"


@pytest.mark.parametrize("layout", ["1x2_ep2", "2x4_ep4"])
def test_resume_on_another_layout_continues_with_the_same_losses(model_dir, uninterrupted, layout, tmp_path):
    """Init (memory_efficient_init), resume, train and save on another layout; 2 nodes x 4 ranks with ep=4 has
    sources with three receivers each and EP inside a node across four ranks."""
    from transformers import AutoModelForCausalLM

    out, ranks = uninterrupted
    nnodes, per_node, per_device, ep = {"1x2_ep2": (1, 2, 4, 2), "2x4_ep4": (2, 4, 1, 4)}[layout]
    resumed_out = tmp_path / "resumed"
    result = launch("save_resume.py", ["--model", model_dir, "--dataset", DATASET, "--output-dir", str(resumed_out),
                                       "--per-device", str(per_device), "--ep", str(ep), "--max-steps", "5",
                                       "--resume", str(out / "checkpoint-3"), "--bucket-bytes", str(BUCKET)],
                    tmp_path / "logs", nnodes=nnodes, nproc_per_node=per_node, timeout=LIMIT)
    assert result.ok(), result.describe()
    resumed = result.rank_results()
    assert sorted(resumed) == list(range(nnodes * per_node))
    assert resumed[0]["start_step"] == 3 and resumed[0]["nodes"] == nnodes
    before = ranks[0]["losses"]
    assert sorted(resumed[0]["losses"]) == ["4", "5"]
    for step in ("4", "5"):
        assert abs(resumed[0]["losses"][step] - before[step]) <= 1e-5, (layout, step, resumed[0]["losses"], before)
    # The checkpoint this layout saved at the end is the model it trained, as plain transformers loads it.
    model, info = AutoModelForCausalLM.from_pretrained(str(resumed_out / "checkpoint-5"), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    gathered = torch.load(resumed_out / "gathered-5.pt", weights_only=True)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, gathered[k])] == []


def test_resume_refuses_another_global_batch(model_dir, uninterrupted, tmp_path):
    out, _ = uninterrupted
    result = launch("save_resume.py", ["--model", model_dir, "--dataset", DATASET, "--output-dir", str(tmp_path / "o"),
                                       "--per-device", "1", "--max-steps", "5", "--resume",
                                       str(out / "checkpoint-3")],
                    tmp_path / "logs", nnodes=1, nproc_per_node=2, timeout=LIMIT)
    assert not result.ok()
    for data in result.rank_results().values():
        assert data["error_type"] == "ResumeError", data
        assert "global_batch=8, this run has global_batch=2" in data["error"]
        assert "keep it" in data["error"]
