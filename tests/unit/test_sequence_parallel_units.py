"""Ulysses sequence parallelism's sizes, refusals and batch split, in this process (the launches are
tests/multiproc/test_sequence_parallel.py's)."""

import pytest
import torch
from cli_cases import DATASET, DEMO

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import ParallelConfigError, StrategyConfigError
from twinkle_strategy.parallel import ParallelDims
from twinkle_strategy.sequence import check_sequence_parallel, loss_tokens, split_batch
from twinkle_strategy.testing.tiny_models import tiny_config


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
