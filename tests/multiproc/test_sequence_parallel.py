"""Ulysses sequence parallelism: exact against one process, and refused by name where it cannot serve."""

import json

import pytest
import torch
from multinode import launch
from test_launch_errors import DATASET, DEMO, only_run_dir, run_cli

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import ParallelConfigError, StrategyConfigError
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.sequence import check_sequence_parallel, loss_tokens, split_batch
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint, tiny_config

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


# ------------------------------------------------------------------ sizes and families, before any process
def test_sizes_are_checked_with_the_constraint_named():
    with pytest.raises(StrategyConfigError, match="sequence_parallel_size=0 is not valid"):
        StrategyConfig(sequence_parallel_size=0)
    with pytest.raises(ParallelConfigError, match="sequence_parallel_size 4 needs 4 processes .* this job has 2"):
        ParallelDims(world_size=2, sp_size=4)
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not divisible by sequence_parallel_size 4; "
                                                  r"choose sequence_parallel_size among \[1, 2, 3, 6\]"):
        ParallelDims(world_size=6, sp_size=4)
    # SP and EP are carved independently: one SP group of 4 spans two EP groups of 2.
    dims = ParallelDims(world_size=4, ep_size=2, sp_size=4)
    assert (dims.dp_size, [dims.dp_rank(r) for r in range(4)], [dims.sp_rank(r) for r in range(4)]) == \
        (1, [0, 0, 0, 0], [0, 1, 2, 3])
    dims = ParallelDims(world_size=8, ep_size=4, sp_size=2)
    assert (dims.dp_size, [dims.dp_rank(r) for r in range(8)]) == (4, [0, 0, 1, 1, 2, 2, 3, 3])


@pytest.mark.parametrize("family,reason", [("gpt_oss", "attention sinks"), ("deepseek_v4", "attention sinks"),
                                           ("qwen3_next", "Gated DeltaNet"), ("nemotron_h", "Mamba-2"),
                                           ("jamba", "Mamba"),
                                           # its text config is qwen3_5_moe_text: still named by the family
                                           ("qwen3_5_moe_vl", "Gated DeltaNet"),
                                           ("llama4", r"layers of type \['chunked_attention'\]")])
def test_families_that_cannot_be_split_are_refused_by_name(family, reason):
    name = family.removesuffix("_vl")
    with pytest.raises(ParallelConfigError, match=f"sequence_parallel_size=2: {name} has {reason}.*use "
                                                  "sequence_parallel_size=1"):
        check_sequence_parallel(tiny_config(family), 2)


def test_heads_must_divide():
    check_sequence_parallel(tiny_config("qwen3_moe"), 4)  # 4 query heads, 2 KV heads: replicated
    check_sequence_parallel(tiny_config("deepseek_v3"), 2)
    with pytest.raises(ParallelConfigError, match=r"sequence_parallel_size=8 must divide the 4 attention heads of "
                                                  r"qwen3_moe .*choose it among \[1, 2, 4\]"):
        check_sequence_parallel(tiny_config("qwen3_moe"), 8)


def test_split_batch_keeps_global_positions_and_shifts_labels_on_the_whole_row():
    ids = torch.arange(10, 17)[None]  # 7 tokens, 2 ranks: padded to 8
    labels = ids.clone()
    labels[0, :2] = -100
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two packed examples
    chunks = [split_batch({"input_ids": ids, "labels": labels, "position_ids": positions}, rank=r, size=2)
              for r in range(2)]
    assert chunks[0]["input_ids"].tolist() == [[10, 11, 12, 13]] and chunks[1]["input_ids"].tolist() == [[14, 15, 16, 0]]
    # Rank 0's last token is labelled with rank 1's first token: the shift happened on the whole row.
    assert chunks[0]["shift_labels"].tolist() == [[-100, 12, 13, 14]]
    assert chunks[1]["shift_labels"].tolist() == [[15, 16, -100, -100]]
    assert chunks[0]["position_ids"].tolist() == [[0, 1, 2, 0]] and chunks[1]["position_ids"].tolist() == [[1, 2, 3, 4]]
    assert chunks[1]["attention_mask"].tolist() == [[1, 1, 1, 0]]
    # The loss's tokens: a chunk counts its shift_labels (rank 1's first column is a real label), the whole row
    # its labels after the first position; the chunks add up to the row.
    whole = {"input_ids": ids, "labels": labels}
    assert [loss_tokens(c) for c in chunks] == [3, 2] and loss_tokens(whole) == 5


def test_left_padded_rows_are_found_for_the_trainers_refusal():
    """The transformers layer refuses a step with a row padded on the left (real tokens would attend to it)."""
    from twinkle_strategy.step.core import left_padded

    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert not left_padded({"attention_mask": right}) and not left_padded({"position_ids": right})
    assert left_padded({"attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])})


def test_global_loss_tokens_takes_batches_not_tensors_of_unknown_shift():
    from twinkle_strategy import NativeFSDPStrategy

    with pytest.raises(TypeError, match=r"takes the batches .* not a Tensor: whether a tensor of labels is already "
                                        r"shifted cannot be told; pass strategy.global_loss_tokens\(\*micro_batches\)"):
        NativeFSDPStrategy(device_type="cpu").global_loss_tokens(torch.zeros(1, 4, dtype=torch.long))


# ------------------------------------------------------------------ twinkle-sft
@pytest.mark.parametrize("args,expected,fix", [
    (["launch.nnodes=1", "launch.nproc_per_node=2", "--sequence_parallel_size", "4"],
     "strategy.sequence_parallel_size (--sequence_parallel_size): sequence_parallel_size 4 and ep_size 2 "
     "(strategy.ep_size, --expert_parallel_size) must each divide the number of processes (SP groups sit inside the "
     "data-parallel and EP ranks, so ep x sp may exceed it), this run has 2 (nodes x processes per node = 1 x 2); "
     "set launch.nproc_per_node=4, or sequence_parallel_size among [1, 2]",
     ["launch.nnodes=1", "launch.nproc_per_node=4", "--sequence_parallel_size", "4"]),
    (["launch.nproc_per_node=4", "--sequence_parallel_size", "8"],
     "strategy.sequence_parallel_size (--sequence_parallel_size): sequence_parallel_size=8 must divide the 4 "
     "attention heads of qwen3_moe (each rank attends with whole heads); choose it among [1, 2, 4]",
     ["launch.nproc_per_node=4", "--sequence_parallel_size", "4"]),
], ids=["world-size", "heads"])
def test_twinkle_sft_refuses_sizes_before_launch(args, expected, fix, tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from twinkle_strategy.train.cli import main, parse
    from twinkle_strategy.train.preflight import check_before_launch

    monkeypatch.chdir(tmp_path)
    for var in ("NPROC_PER_NODE", "NNODES", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    base = [DEMO, f"data.dataset={DATASET}", f"train.output_dir={tmp_path / 'out'}"]
    assert main([*base, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"twinkle-sft: error: {expected}\n", captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == [] and not dist.is_initialized()
    check_before_launch(parse([*base, *fix]))  # the fix passes every check (the run below trains with one)


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
