"""Ulysses sequence parallelism: exact against one process, and refused by name where it cannot serve."""

import pytest
from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

SP_FAMILIES = ("qwen3_moe", "deepseek_v3")  # GQA (2 KV heads for 4 query heads), MLA


@pytest.fixture(scope="module")
def sp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_ckpts")
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe"), seed=0)
    # MLA expands its latent into one key per query head; DeepSeek-V3's config says so (num_key_value_heads =
    # num_attention_heads = 128). The tiny default's 2 would make transformers' own sdpa repeat keys that are
    # already per head, failing on one process too.
    save_tiny_checkpoint("deepseek_v3", str(root / "deepseek_v3"), seed=0, num_key_value_heads=4)
    return root


@pytest.mark.parametrize("nnodes,nproc,sp,ep", [(2, 2, 2, 2), (1, 4, 4, 2)], ids=["2x2-sp2-ep2", "1x4-sp4-ep2"])
def test_ulysses_matches_one_process(sp_checkpoints, tmp_path, nnodes, nproc, sp, ep):
    """Logits of every real token, the global loss and the gradient norm equal one process on the whole
    sequences (fp32), for right-padded rows and for packed rows, with activation checkpointing on.
    sp=4 with 2 KV heads replicates each KV head on two ranks."""
    result = launch("ulysses_parity.py", ["--ckpt-root", str(sp_checkpoints), "--ep", str(ep), "--sp", str(sp)],
                    tmp_path, nnodes=nnodes, nproc_per_node=nproc, timeout=600)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        seen = {(c["family"], c["batch"]) for c in data["cases"]}
        assert seen == {(f, b) for f in SP_FAMILIES for b in ("padded", "packed")}
        for c in data["cases"]:
            case = f"rank {rank} {c['family']} {c['batch']} sp={sp} ep={ep}"
            assert c["chunk_tokens"] * sp in (22, 24, 21 + (-21 % sp)), case  # each rank holds only its chunk
            assert c["logit_diff"] <= 1e-5, f"{case}: logits differ by {c['logit_diff']}"
            assert abs(c["loss"] - c["ref_loss"]) <= 1e-5, f"{case}: loss {c['loss']} vs {c['ref_loss']}"
            assert abs(c["norm"] - c["ref_norm"]) <= 1e-5 * c["ref_norm"], f"{case}: grad norm {c['norm']} vs {c['ref_norm']}"
