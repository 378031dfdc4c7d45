"""Ulysses sequence parallelism: exact against one process, and refused by name where it cannot serve."""

import json

import pytest
from multinode import launch
from test_launch_errors import DATASET, DEMO, only_run_dir, run_cli

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

SP_FAMILIES = ("qwen3_moe", "deepseek_v3")  # GQA (2 KV heads for 4 query heads), MLA


@pytest.fixture(scope="module")
def sp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_ckpts")
    # Hub layout: several safetensors files and an index, as released checkpoints are.
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe"), seed=0, max_shard_size="40KB")
    # MLA expands its latent into one key per query head; DeepSeek-V3's config says so (num_key_value_heads =
    # num_attention_heads = 128). The tiny default's 2 would make transformers' own sdpa repeat keys that are
    # already per head, failing on one process too.
    save_tiny_checkpoint("deepseek_v3", str(root / "deepseek_v3"), seed=0, num_key_value_heads=4,
                         max_shard_size="40KB")
    save_tiny_checkpoint("gpt_oss", str(root / "gpt_oss"), seed=0)  # attention sinks: refused
    save_tiny_checkpoint("qwen3_5_moe_vl", str(root / "qwen3_5_moe"), seed=0)  # Gated DeltaNet: refused
    return root


REFUSED = {"gpt_oss": "gpt_oss has attention sinks", "qwen3_5_moe": "qwen3_5_moe has Gated DeltaNet linear attention"}


# ------------------------------------------------------------------ exact against one process
@pytest.mark.parametrize("nnodes,nproc,sp,ep", [(2, 2, 2, 2), (1, 4, 4, 2)], ids=["2x2-sp2-ep2", "1x4-sp4-ep2"])
def test_ulysses_matches_one_process(sp_checkpoints, tmp_path, nnodes, nproc, sp, ep):
    """Logits of every real token, the global loss and the gradient norm equal one process on the whole
    sequences (fp32), for right-padded rows and for packed rows, with activation checkpointing on.
    sp=4 with 2 KV heads replicates each KV head on two ranks; the loss divides by strategy.global_loss_tokens of
    the chunks. Then gpt-oss (sinks) and Qwen3.5-MoE (Gated DeltaNet) are refused by name on every rank, before
    their weights load, and every rank exits."""
    refused = ",".join(str(sp_checkpoints / name) for name in REFUSED)
    result = launch("ulysses_parity.py", ["--ckpt-root", str(sp_checkpoints), "--ep", str(ep), "--sp", str(sp),
                                          "--refused", refused],
                    tmp_path, nnodes=nnodes, nproc_per_node=nproc, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        seen = {(c["family"], c["batch"]) for c in data["cases"]}
        assert seen == {(f, b) for f in SP_FAMILIES for b in ("padded", "packed")}
        for c in data["cases"]:
            case = f"rank {rank} {c['family']} {c['batch']} sp={sp} ep={ep}"
            assert c["chunk_tokens"] == -(-{"padded": 22, "packed": 21}[c["batch"]] // sp), case  # only its chunk
            assert c["logit_diff"] <= 1e-5, f"{case}: logits differ by {c['logit_diff']}"
            assert abs(c["loss"] - c["ref_loss"]) <= 1e-5, f"{case}: loss {c['loss']} vs {c['ref_loss']}"
            assert abs(c["norm"] - c["ref_norm"]) <= 1e-5, f"{case}: grad norm {c['norm']} vs {c['ref_norm']}"
        for name, expected in REFUSED.items():
            # Every rank raised the refusal itself, from the config (no rank read a weight, none waits).
            refusal = data["refusals"][name]
            assert "failed on rank(s) [0, 1, 2, 3]" in refusal and "\n" not in refusal, (rank, refusal)
            for r in range(4):
                assert f"rank {r}: ParallelConfigError: sequence_parallel_size={sp}: {expected}, which Ulysses " \
                       "sequence parallelism cannot split along the sequence; use sequence_parallel_size=1" in refusal, \
                    (rank, refusal)


def read_log(output_dir) -> list[dict]:
    with open(only_run_dir(output_dir) / "logging.jsonl") as f:
        return [json.loads(line) for line in f]


def flops_per_token(line: dict) -> float:
    """tflops_per_device / tokens_per_second: the FLOPs model's figure per token, whatever the step took."""
    return line["tflops_per_device"] / line["tokens_per_second"]


def test_twinkle_sft_packing_with_sequence_parallel_logs_the_losses_of_the_run_without_it(tmp_path):
    """The demo (LoRA on attention and experts, ep=2, memory_efficient_init) on 2 ranks, packed, with the global
    aux loss: sequence_parallel_size 2 (one data-parallel group: a row of 2 packs, cut in two) logs the losses,
    aux losses, gradient norms and expert load of the run without it (2 ranks x 1 pack), in fp32. That run, resumed from its step-1 checkpoint, builds the same packs and logs the same steps 2 and 3."""
    # Packs of up to 96 tokens hold three demo examples; step 3's row of two packs has 183 tokens, which the split
    # pads by one token (steps 1 and 2 are even).
    base = [DEMO, f"data.dataset={DATASET}", "launch.nnodes=1", "launch.nproc_per_node=2", "train.max_steps=3",
            "train.logging_steps=1", "--mixed_precision", "no", "--torch_dtype", "float32", "--packing", "true",
            "data.max_length=96", "--router_aux_loss_coef", "0.05"]
    runs = {"sp": ["train.per_device_train_batch_size=2", "--sequence_parallel_size", "2"],
            "ref": ["train.per_device_train_batch_size=1", "train.save_steps=1"]}
    logged = {}
    for name in ("sp", "ref", "resumed"):
        if name == "resumed":
            checkpoint = only_run_dir(tmp_path / "ref") / "checkpoint-1"
            runs[name] = [*runs["ref"], f"train.resume_from_checkpoint={checkpoint}"]
        extra = runs[name]
        proc = run_cli([*base, f"train.output_dir={name}", *extra], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logged[name] = read_log(tmp_path / name)
    assert len(logged["sp"]) == len(logged["ref"]) == 3 and len(logged["resumed"]) == 2
    for sp, ref in zip(logged["sp"], logged["ref"], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(sp[key] - ref[key]) <= 1e-5, (key, sp, ref)
        # Expert load counts real tokens only (not the padding that evens a row out for the split).
        assert sp["moe_load_imbalance"] == ref["moe_load_imbalance"], (sp, ref)
        # The attention FLOPs of a chunk's token are those of its whole packed example, as without the split
        # (tflops_per_device is rounded to 6 decimals, hence 2%; the chunk's length instead is 20% off).
        assert flops_per_token(sp) == pytest.approx(flops_per_token(ref), rel=0.02), (sp, ref)
    for resumed, ref in zip(logged["resumed"], logged["ref"][1:], strict=True):
        assert resumed["global_step/max_steps"] == ref["global_step/max_steps"]
        for key in ("loss", "aux_loss", "grad_norm", "moe_load_imbalance"):
            assert abs(resumed[key] - ref[key]) <= 1e-5, (key, resumed, ref)
