"""bf16 as users run it: every tensor keeps the dtype one process gives it, routing included.

Families whose transformers class keeps tensors in fp32 under bf16 (DeepSeek-V3's router bias,
DeepSeek-V4's norms, sinks and hyper-connections, Ernie-4.5's router weight, GLM-4.5-MoE's router
bias), in the hub layout, sharded into several files, loaded with ``dtype=torch.bfloat16`` and
``mixed_precision='bf16'`` (LoRA: 'no', see the worker), against plain ``from_pretrained(dtype=torch.bfloat16)``
in one process:
with and without memory_efficient_init, LoRA and full, and with the in-memory path forced.
One launch on 2 nodes x 2 (ep=2) runs the matrix, one on 2 nodes x 4 (ep=4) a row of it.

Oracle and tolerances. The single process loads the checkpoint as users do; it runs each rank's rows
alone for logits and routing (on the CPU a bf16 matmul's rounding depends on the batch shape) and the
whole batch for loss and gradient norm. Weights, dtypes and the first MoE layer's routing are exact:
everything before the first router runs the same bf16 operations on the same shapes. From the first
MoE layer on, EP computes each expert on the tokens of several ranks (other matmul shapes), sums
expert outputs in another order, and FSDP reduces gradients across ranks, so results differ by bf16
rounding, u = 2^-8 relative (unit roundoff: 8 significand bits), a few roundings per layer over
about 4 layers; a token whose later layer broke a near-tie otherwise is counted, not compared.
* logits of tokens routed as in one process: 16 u of the largest logit (about 4 layers x 4 roundings;
  measured up to 9 u, on a token whose neighbour was routed otherwise);
* loss, a mean over 64-256 tokens of per-token errors that average out: u relative (measured 0.2 u);
* gradient norm, which also moves where a token changed experts: 8 u relative (measured 2 u).

The reduce dtype (``reduce_dtype``, 2 nodes x 2, DeepSeek-V3, full parameters): one backward, its gradients summed
across ranks in fp32 (the default) and in bf16, everything else the same. Each rank's gradient is bf16 either way
(mixed_precision='bf16'); fp32 sums the M ranks of a reduction nearly exactly and rounds the mean once to the bf16
shard, bf16 rounds each of the M - 1 partial sums and the mean. So each element differs by at most (M + 1) u times
the mean over those ranks of |gradient|, first order; the worker measures each rank's own contribution (its
reduced gradient with every other rank's loss scaled by 0) and the bound is checked element by element against
their absolute sum, at (world + 2) u (M <= world; one u more for the fp32 sum's own roundings and second-order
terms). fp32-kept parameters (DeepSeek-V3's router) reduce in fp32 under either setting: bit for bit.
"""

import math

import pytest
import torch
from multinode import launch
from roundtrip_checks import check_roundtrips

from twinkle_strategy.testing.tiny_models import build_tiny_model, save_tiny_checkpoint

U = 2.0 ** -8  # bf16 unit roundoff (8 significand bits with the implicit one)
LOGIT_TOLERANCE, LOSS_TOLERANCE, NORM_TOLERANCE = 16 * U, U, 8 * U
FAMILIES = ("deepseek_v3", "deepseek_v4", "ernie4_5_moe", "glm4_moe")
# Checkpoints as released (bf16, fp32-kept tensors in fp32) for some, fp32 (cast while loading) for others.
SAVED_AS_RELEASED = ("deepseek_v3", "ernie4_5_moe")
# Several MoE layers (DeepSeek-V4's tiny config has three: hash-routed, then learned).
LAYERS = {"deepseek_v3": {"num_layers": 4}, "deepseek_v4": {},
          "ernie4_5_moe": {"num_hidden_layers": 4, "moe_layer_end_index": 3}, "glm4_moe": {"num_hidden_layers": 4}}
CASES_2X2 = ([f"{f}:{m}" for f in FAMILIES for m in ("full", "lora", "full-plain")]
             + ["ernie4_5_moe:lora-plain", "deepseek_v3:full-inmemory"])
CASES_2X4 = ["deepseek_v3:full", "ernie4_5_moe:full-plain", "deepseek_v4:lora", "glm4_moe:full-inmemory"]
# Then, at 4 ranks per node (a source with 3 receivers), saved and resumed in bf16 from sharded checkpoints:
# LongCat-Flash's zero-computation slots as rows; Bailing-Hybrid's conv1d and expert lora_B by one owner rank.
ROUNDTRIPS_2X4 = ("longcat_flash", "bailing_hybrid", "longcat_flash+lora")


def save_checkpoint(family: str, path: str) -> None:
    """A tiny ``family`` checkpoint in the hub layout, several files, with several MoE layers and a non-zero
    router bias (fp32 bits a bf16 rounding would lose)."""
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(family, seed=3, **LAYERS[family])
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.01)
    if family not in SAVED_AS_RELEASED:
        model.save_pretrained(path, max_shard_size="40KB")
        return
    model.save_pretrained(path + "-fp32", max_shard_size="40KB")
    released = AutoModelForCausalLM.from_pretrained(path + "-fp32", dtype=torch.bfloat16)
    released.save_pretrained(path, max_shard_size="40KB")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    for family in FAMILIES:
        save_checkpoint(family, str(root / family))
    for family in ("longcat_flash", "bailing_hybrid"):
        save_tiny_checkpoint(family, str(root / family), max_shard_size="40KB")
    return root


def check_cases(ranks: dict, expected: list[str]) -> list[float]:
    """Assert every case of every rank; return the later layers' routing differences."""
    later = []
    for rank, data in ranks.items():
        assert [f"{c['family']}:{c['mode']}" for c in data["cases"]] == expected
        for c in data["cases"]:
            case = f"rank {rank} {c['family']} {c['mode']} ep={c['ep']}"
            assert c["dtype_mismatches"] == [], f"{case}: dtypes differ from from_pretrained(dtype=bf16)"
            assert c["state_mismatches"] == [], f"{case}: weights after init differ from the single process"
            assert c["compute_dtypes"] == c["ref_compute_dtypes"], \
                f"{case}: fp32-kept parameters compute in {c['compute_dtypes']}, one process in " \
                f"{c['ref_compute_dtypes']}"
            assert c["moe_layers"] == c["ref_moe_layers"], case
            if c["moe_layers"]:  # (Llama-4's pre-routed experts call shows no routing to compare)
                assert c["routing_differences"][0] == 0.0, f"{case}: first MoE layer routes differently"
            later += c["routing_differences"][1:]
            assert c["same_routing_tokens"] >= 0.75 * c["tokens"], f"{case}: logits compared on too few tokens"
            assert c["logit_diff"] <= LOGIT_TOLERANCE * c["logit_scale"], f"{case}: logits differ by {c['logit_diff']}"
            assert abs(c["loss"] - c["ref_loss"]) <= LOSS_TOLERANCE * c["ref_loss"], \
                f"{case}: loss {c['loss']} vs {c['ref_loss']}"
            assert math.isfinite(c["norm"]) and c["ref_norm"] > 0
            assert abs(c["norm"] - c["ref_norm"]) <= NORM_TOLERANCE * c["ref_norm"], \
                f"{case}: gradient norm {c['norm']} vs {c['ref_norm']}"
    return later


@pytest.mark.parametrize("layout", ["2x2_ep2", "2x4_ep4"])
def test_bf16_matches_one_process(checkpoints, layout, tmp_path):
    per_node, ep, cases = {"2x2_ep2": (2, 2, CASES_2X2), "2x4_ep4": (4, 4, CASES_2X4)}[layout]
    changed = ["--changed-on-sources", "deepseek_v3", "--reduce-dtype", "deepseek_v3"] if per_node == 2 else []
    roundtrips = ROUNDTRIPS_2X4 if per_node == 4 else ()
    result = launch("bf16_parity.py", ["--ckpt-root", str(checkpoints), "--cases", ",".join(cases), "--ep", str(ep),
                                       "--roundtrip", ",".join(roundtrips), *changed],
                    tmp_path, nnodes=2, nproc_per_node=per_node, timeout=900)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == list(range(2 * per_node))
    later = check_cases(ranks, cases)
    if roundtrips:
        check_roundtrips(ranks, roundtrips, two_runs=False)
    for c in ranks[0]["cases"]:
        assert c["kept"], f"{c['family']}: transformers keeps no tensor in fp32, the case tests nothing"
        assert c["moe_layers"] >= 2, f"{c['family']}: one MoE layer, no later layer to report on"
    if changed:
        check_changed_on_sources(ranks, str(checkpoints / "deepseek_v3"))
        check_reduce_dtype(ranks, world=2 * per_node)
    # Reported (not asserted): how often bf16 rounding broke a near-tie differently in a later MoE layer,
    # and the largest differences in units of u.
    cases = [c for data in ranks.values() for c in data["cases"]]
    worst = {what: max(f(c) for c in cases) / U for what, f in (
        ("logits", lambda c: c["logit_diff"] / c["logit_scale"]),
        ("loss", lambda c: abs(c["loss"] - c["ref_loss"]) / c["ref_loss"]),
        ("grad norm", lambda c: abs(c["norm"] - c["ref_norm"]) / c["ref_norm"]))}
    print(f"\n{layout}: later MoE layers route {100 * sum(later) / len(later):.2f}% of tokens differently "
          f"(worst layer {100 * max(later):.2f}%); largest relative differences: "
          + ", ".join(f"{what} {value:.2f} u" for what, value in worst.items()))


def check_reduce_dtype(ranks: dict, world: int) -> None:
    """Gradients reduced in bf16 within (world + 2) u of the ranks' absolute sum of the fp32-reduced ones (module
    docstring); fp32-kept parameters' bit for bit."""
    cases = [data["reduce_dtype"] for data in ranks.values()]
    for rank, c in enumerate(cases):
        assert c["kept"] and c["kept_equal"], f"rank {rank}: fp32-kept gradients {c['kept']} changed with reduce_dtype"
        assert c["bf16_grads"] > 10 and c["differ"] > 0, f"rank {rank}: the bf16 reduce changed nothing: {c}"
        assert c["worst_in_u"] <= world + 2, f"rank {rank}: {c['worst_in_u']:.2f} u of the ranks' absolute sum"
    print(f"\nreduce_dtype=bfloat16 at world size {world}: worst element {max(c['worst_in_u'] for c in cases):.2f} u "
          f"of the ranks' absolute sum (bound {world + 2}); gradient norm of the difference "
          f"{cases[0]['relative_norm_difference']:.2e} of the fp32-reduced gradient's")


def check_changed_on_sources(ranks: dict, checkpoint: str) -> None:
    """Sources that cast the model to bf16 (router bias included) before wrap_model: every rank stops with
    the same error, naming the first fp32-kept tensor, both dtypes and why transformers keeps it in fp32.

    Which tensors are kept, and so which one comes first, is the installed transformers' answer (5.24 keeps
    DeepSeek-V3's router weight in fp32 too, 5.23 only its bias): asked here, not written in."""
    from transformers import AutoConfig

    from twinkle_strategy.dtypes import kept_reasons
    from twinkle_strategy.loading import meta_skeleton

    (first, reason), *_ = kept_reasons(meta_skeleton(AutoConfig.from_pretrained(checkpoint), torch.bfloat16),
                                       torch.bfloat16).items()
    errors = {data["changed"]["error"] for data in ranks.values()}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert {data["changed"]["error_type"] for data in ranks.values()} == {"DistributedInitError"}
    assert f"'{first}' is torch.bfloat16 on source rank" in error, error
    assert f"but torch.float32 in the receiving rank's model ({reason})" in error, error
    assert "DeepseekV3ForCausalLM._keep_in_fp32_modules_strict" in reason, reason
    assert "load with the same dtype" not in error


def test_skeleton_has_the_dtypes_of_from_pretrained(checkpoints):
    """The model every rank builds from the config (and the source's streaming skeleton) has each tensor in the
    dtype plain from_pretrained(dtype=bf16) gives it, fp32-kept ones included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinkle_strategy.loading import meta_skeleton

    for family in FAMILIES:
        path = str(checkpoints / family)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
        skeleton = meta_skeleton(AutoConfig.from_pretrained(path), torch.bfloat16).state_dict(keep_vars=True)
        assert {k: v.dtype for k, v in skeleton.items()} == {k: v.dtype for k, v in loaded.items()}, family
        assert any(v.dtype == torch.float32 for v in loaded.values()), family
