"""LoRA on fused experts computed on the activations, at 2 nodes x 2 ranks (ep=2), against PEFT's own path.

One launch (tests/workers/lora_experts.py) runs every family of the matrices twice on the same ranks,
``lora_experts: peft`` and ``lora_experts: activations``: fp32 losses and gradient shards within 1e-5, and
a few families in bf16 (identical first-layer routing, loss within two bf16 ulps: see
tests/unit/test_lora_experts.py) and a few without EP (FSDP2 only). EP's class stays outermost, so it dispatches and the local experts compute
LoRA on the activations.
"""

import pytest
from multinode import launch

from twinkle_strategy.testing.families import FAMILIES, MATRIX_FAMILIES
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

FP32_FAMILIES = tuple(dict.fromkeys(MATRIX_FAMILIES + FAMILIES))
BF16_FAMILIES = ("qwen3_moe", "gpt_oss", "llama4", "longcat_flash")
EP1_FAMILIES = ("qwen3_moe", "llama4")  # FSDP2 without EP: the same compute, no dispatch around it
ROWS_CHECKPOINT = "rows_qwen3_moe"  # what the rows received cost, with and without layer-level checkpointing


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_experts")
    for family in FP32_FAMILIES:
        save_tiny_checkpoint(family, str(root / family), seed=0)
    # (An intermediate size that is neither the hidden size nor half of it: a [rows, hidden] tensor is a row's.)
    save_tiny_checkpoint("qwen3_moe", str(root / ROWS_CHECKPOINT), seed=0, moe_intermediate_size=24)
    return root


def test_activations_path_matches_peft_at_ep2(checkpoints, tmp_path):
    result = launch("lora_experts.py", ["--ckpt-root", str(checkpoints), "--families", ",".join(FP32_FAMILIES),
                                        "--bf16", ",".join(BF16_FAMILIES), "--ep1", ",".join(EP1_FAMILIES),
                                        "--rows", ROWS_CHECKPOINT],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=900)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        cases = data["cases"]
        assert [c["family"] for c in cases] == list(FP32_FAMILIES + BF16_FAMILIES + EP1_FAMILIES)
        assert [c["ep"] for c in cases] == [2] * len(FP32_FAMILIES + BF16_FAMILIES) + [1] * len(EP1_FAMILIES)
        for c in cases:
            case = f"rank {rank} {c['family']} {c['dtype']} ep={c['ep']}"
            assert c["expert_lora_grads"] > 0 and c["same_grad_names"], case
            assert c["same_first_routing"], f"{case}: first-layer routing differs"
            # EP outermost (it dispatches), LoRA on the activations under it (the local experts' compute).
            ep_class = ["ExpertParallelExperts"] if c["ep"] > 1 else []
            assert c["classes"] and all(mro == ep_class + ["LoraOnActivationsExperts"]
                                        for mro in c["classes"]), f"{case}: {c['classes']}"
            assert all(mro == ep_class for mro in c["ref_classes"]), f"{case}: {c['ref_classes']}"
            if c["dtype"] == "torch.float32":
                assert abs(c["loss"] - c["ref_loss"]) <= 1e-5, f"{case}: loss {c['loss']} vs {c['ref_loss']}"
                assert c["max_grad_diff"] <= 1e-5, f"{case}: {c['worst_grad']} differs by {c['max_grad_diff']}"
            else:
                two_ulps = 2 * 2**-7 * abs(c["ref_loss"])
                assert abs(c["loss"] - c["ref_loss"]) <= two_ulps, f"{case}: loss {c['loss']} vs {c['ref_loss']}"
        check_received_rows(rank, data["rows"])


def check_received_rows(rank: int, rows: dict):
    """Under EP the experts' input is the rows this rank received, which A's gradient needs. They are not kept
    for the backward: the region that reads them starts from the tokens before the dispatch, and its
    recomputation sends them again, one more all-to-all per MoE layer in the backward. So the forward keeps no
    more tensors of the received rows' shape than with LoRA on attention alone (where the frozen experts keep
    none of their inputs). Inside layer-level checkpointing the record keeps them anyway: the rows are at hand,
    and the result is still PEFT's within 1e-5."""
    experts, attention = rows["experts"], rows["attention"]
    layers = experts["moe_layers"]
    assert experts["received_counts"], f"rank {rank}: no rows received"
    assert experts["kept_received_rows"] <= attention["kept_received_rows"], (rank, experts, attention)
    assert experts["forward_all_to_alls"] == attention["forward_all_to_alls"], (rank, experts, attention)
    assert experts["backward_all_to_alls"] == attention["backward_all_to_alls"] + layers, (rank, experts, attention)
    checkpointed = rows["checkpointed"]
    case = f"rank {rank} {checkpointed['family']} with layer checkpointing"
    assert checkpointed["checkpointing"] and checkpointed["same_grad_names"], case
    assert abs(checkpointed["loss"] - checkpointed["ref_loss"]) <= 1e-5, case
    assert checkpointed["max_grad_diff"] <= 1e-5, f"{case}: {checkpointed['worst_grad']}"
