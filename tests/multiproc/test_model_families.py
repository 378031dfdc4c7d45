"""Every kind of experts call contract, against a single process (2 nodes x 2 ranks, ep=2, memory_efficient_init).

One launch runs the whole matrix: Llama-4 (pre-routed experts), Nemotron-H
(non-gated experts), LongCat-Flash (zero-computation experts), each also with
LoRA on attention and its experts, and a representative set of the routed
families; then the models EP must refuse at wrap_model, on every rank. The same launch runs a few
families in bf16 against one process in bf16 (tests/multiproc/test_bf16.py's checks).
"""

import pytest
from multinode import launch
from roundtrip_checks import check_roundtrips
from test_bf16 import check_cases as check_bf16_cases

from twinkle_strategy.testing.families import MATRIX_FAMILIES, REFUSED_FAMILIES, VISION_LANGUAGE_FAMILIES
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

FAMILIES = MATRIX_FAMILIES + VISION_LANGUAGE_FAMILIES
# Also run in bf16, against one process in bf16 (the checks of tests/multiproc/test_bf16.py): the families of the matrix
# whose transformers class keeps tensors in fp32 (Nemotron-H's router bias, DeepSeek-V4's norms, sinks and
# hyper-connections), Bailing-Hybrid (its attention uses its fp32-kept conv1d's weight without calling conv1d),
# and the two whose experts take another dispatch path (pre-routed, zero experts).
BF16_FAMILIES = ("nemotron_h", "deepseek_v4", "bailing_hybrid", "llama4", "longcat_flash")
LORA_FAMILIES = ("llama4", "nemotron_h", "longcat_flash") + VISION_LANGUAGE_FAMILIES
# Saved and resumed after init: LongCat-Flash's zero-computation slots are written and read as rows like any
# expert; Bailing-Hybrid's conv1d (transformers fuses q/k/v convolutions with Concatenate(dim=0)) and expert
# lora_B (experts along dim 1) only whole, by one owner rank.
ROUNDTRIPS = ("longcat_flash", "bailing_hybrid", "longcat_flash+lora")
REFUSED = {
    "dbrx": "dbrx",
    "jetmoe": "jetmoe",
    "unknown_forward": "qwen3_moe",  # its experts swapped for a module with another forward
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family in dict.fromkeys(FAMILIES + REFUSED_FAMILIES + BF16_FAMILIES):
        save_tiny_checkpoint(family, str(root / family), seed=0)
    return root


def test_families_match_single_process_or_are_refused(family_checkpoints, tmp_path):
    refused = ",".join(f"{name}={directory}" for name, directory in REFUSED.items())
    result = launch("family_matrix.py", ["--ckpt-root", str(family_checkpoints), "--families", ",".join(FAMILIES),
                                         "--lora", ",".join(LORA_FAMILIES), "--refused", refused,
                                         "--bf16", ",".join(BF16_FAMILIES), "--roundtrip", ",".join(ROUNDTRIPS)],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=900)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    expected_runs = [(f, False) for f in FAMILIES] + [(f, True) for f in LORA_FAMILIES]
    for rank, data in ranks.items():
        assert [(c["family"], c["lora"]) for c in data["cases"]] == expected_runs
        for c in data["cases"]:
            case = f"rank {rank} {c['family']}{' + LoRA' if c['lora'] else ''}"
            assert c["expert_tensors"] > 0, case
            assert c["train_mode"], f"{case}: training-mode forward is random, compared in eval mode"
            if c["lora"]:
                assert c["lora_tensors"] > 0, case
            if c["family"] == "longcat_flash":  # the router did pick zero-computation experts
                assert c["zero_expert_choices"] > 0, case
            assert c["state_mismatches"] == [], f"{case}: weights after init differ from the single process"
            assert c["own_experts_ok"], f"{case}: local expert tensors are not this rank's experts"
            assert c["logit_diff"] <= 1e-5, f"{case}: logits differ by {c['logit_diff']}"
            assert abs(c["loss"] - c["ref_loss"]) <= 1e-5, f"{case}: loss {c['loss']} vs {c['ref_loss']}"
            assert c["ref_norm"] > 0
            assert abs(c["norm"] - c["ref_norm"]) <= 1e-5 * c["ref_norm"], \
                f"{case}: gradient norm {c['norm']} vs {c['ref_norm']}"
            if c["family"] in VISION_LANGUAGE_FAMILIES:
                # The checkpoint's own class, vision tower included (not the text-only class dropping it).
                assert c["model_class"].endswith("ForConditionalGeneration") and c["vision_tensors"] > 0, case
                if c["lora"]:
                    # The saved adapter loads with plain PEFT onto the vision-language class, same logits.
                    adapter = c["adapter"]
                    assert adapter["base_class"] == c["model_class"] and adapter["lora_tensors"] > 0, adapter
                    assert adapter["logit_diff"] <= 1e-5, f"{case}: adapter logits differ by {adapter['logit_diff']}"

        assert [c["kept"] != [] for c in data["bf16_cases"]] == [True, True, True, False, False]
        errors = {r["name"]: r for r in data["refused"]}
        assert set(errors) == set(REFUSED)
        for name, r in errors.items():
            assert r["error_type"] == "ModelStructureError", f"rank {rank} {name}: {r}"
            assert "is not supported with ep_size > 1 yet" in r["error"] and "Use ep_size=1" in r["error"], r
        assert "DbrxForCausalLM (model_type 'dbrx')" in errors["dbrx"]["error"]
        assert "DbrxExperts" in errors["dbrx"]["error"] and "keeps parameters in child modules" in errors["dbrx"]["error"]
        assert "JetMoeForCausalLM (model_type 'jetmoe')" in errors["jetmoe"]["error"]
        assert "has forward(layer_input)" in errors["jetmoe"]["error"]
        assert "SelfRoutingExperts" in errors["unknown_forward"]["error"]
        assert "has forward(hidden_states, router_logits), which is no experts call we have a dispatch for" \
            in errors["unknown_forward"]["error"]
    check_bf16_cases({rank: {"cases": data["bf16_cases"]} for rank, data in ranks.items()},
                     [f"{family}:full" for family in BF16_FAMILIES])
    check_roundtrips(ranks, ROUNDTRIPS, two_runs=True)
    # Every rank raised the same error (the model structure is the same everywhere).
    for name in REFUSED:
        assert len({next(r["error"] for r in d["refused"] if r["name"] == name) for d in ranks.values()}) == 1

