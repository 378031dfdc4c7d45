"""LoRA over a frozen base kept as the release stores it (``quantized_base: keep``), on 2 nodes x 2, ep=2, bf16.

For FP8 blocks (DeepSeek-V3 with a ragged last block), DeepSeek-V4 FP4 experts and gpt-oss MXFP4, with
adapters on attention and experts, three SGD steps with ``keep`` and with ``dequantize``. Tolerance: none.
``keep`` decodes the same stored bytes with the same decoder into the same dtype as ``dequantize`` does on
arrival, and FSDP2 gathers those values into the same unsharded weights, so every operation of the step
sees the same inputs: logits, losses and gradients are equal bit for bit (a difference is a bug, not rounding).
"""

import re

import pytest
import torch
from multinode import launch

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import StrategyConfigError
from twinkle_strategy.testing.releases import (
    save_tiny_deepseek_v4_release,
    save_tiny_mxfp4_release,
    save_tiny_quantized_checkpoint,
)

BLOCK = (16, 16)
BUCKET = 1 << 14  # tests/workers/keep_export.py's bucket bytes
SIZES = dict(hidden_size=64, intermediate_size=32)  # DeepSeek's kv_a_proj_with_mqa: 20 rows, a ragged last block
# What keep holds of the quantized weights, against the same regions in bf16 (the goals).
GOALS = {"fp8_block": 0.55, "fp4_block": 0.3, "mxfp4": 0.3}
# What a kept weight stores (data and scale dtypes): FP8 with float32 scales; DeepSeek-V4's FP8 dense weights
# with ue8m0 scales and its FP4 experts (two e2m1 per int8) with ue8m0 scales; MXFP4 blocks and exponents.
FP8 = ["torch.float32", "torch.float8_e4m3fn"]
V4_DENSE, V4_EXPERTS = ["torch.float8_e4m3fn", "torch.float8_e8m0fnu"], ["torch.float8_e8m0fnu", "torch.int8"]
STORED_DTYPES = {"deepseek_fp8": lambda name: FP8,
                 "deepseek_v4": lambda name: V4_EXPERTS if ".experts." in name else V4_DENSE,
                 "gpt_oss_mxfp4": lambda name: ["torch.uint8"]}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep")
    return {"deepseek_fp8": save_tiny_quantized_checkpoint("deepseek_v3", str(root / "deepseek_fp8"), BLOCK, **SIZES),
            "deepseek_v4": save_tiny_deepseek_v4_release(str(root / "deepseek_v4"), BLOCK, **SIZES),
            "gpt_oss_mxfp4": save_tiny_mxfp4_release(str(root / "gpt_oss_mxfp4"), **SIZES)}


def test_keep_is_a_strategy_option_that_needs_the_streamed_init():
    assert StrategyConfig().quantized_base == "dequantize"
    assert StrategyConfig(quantized_base="keep", memory_efficient_init=True).quantized_base == "keep"
    with pytest.raises(StrategyConfigError, match="quantized_base='keep'.*memory_efficient_init=true"):
        StrategyConfig(quantized_base="keep")
    with pytest.raises(StrategyConfigError, match="quantized_base='keep'.*stream_checkpoint"):
        StrategyConfig(quantized_base="keep", memory_efficient_init=True, stream_checkpoint=False)
    with pytest.raises(StrategyConfigError, match="quantized_base='nf4'.*dequantize"):
        StrategyConfig(quantized_base="nf4", memory_efficient_init=True)
    # One field: the recipe key, the twinkle-sft flag and the swift plugin's TWINKLE_QUANTIZED_BASE come from it.
    from twinkle_strategy.integrations.swift import plugin
    from twinkle_strategy.train import cli

    assert "quantized_base" in plugin.option_names()
    assert "--quantized_base" in cli.build_parser().format_help()


def check_case(name: str, case: dict, rank: int) -> None:
    where = (rank, name)
    assert case["kept"] and case["ref_kept"] == [], where  # keep holds weights as stored, dequantize none
    for param, dtypes in case["stored_dtypes"].items():
        assert dtypes == STORED_DTYPES[name](param), (where, param, dtypes)
    assert case["bytes_unchanged"], where
    assert case["grad_count"] > 0 and case["grad_name_mismatch"] == [], where
    assert case["logit_diff"] == 0.0 and case["grad_diff"] == 0.0, (where, case)
    assert case["losses"] == case["ref_losses"], (where, case["losses"], case["ref_losses"])
    assert case["losses"][-1] < case["losses"][0], where  # the adapters learn
    for kind, stored in case["frozen_stored"].items():
        assert stored <= GOALS[kind] * case["frozen_values"][kind], (where, kind, case["log_line"])
    # Every quantized region of the release is kept as stored (none decoded at the init), and held so.
    assert case["frozen_decoded"] == [], (where, case["frozen_decoded"])
    assert case["held"] == sum(case["frozen_stored"].values()) < case["ref_held"], where
    assert case["ref_held"] == sum(case["frozen_values"].values()), where
    # The decoder runs where the stored bytes are: decoding every kept region on the meta device (no data, so
    # no value can be read back to the host) gives the region's shape and dtype there.
    assert case["meta_decode_failures"] == [], (where, case["meta_decode_failures"])
    # Decoded just in time: each step decodes every kept shard for the forward and again for the backward's input
    # gradient (where the backward gathers the unit again: in the tiny DeepSeek-V4, about 2% of the kept bytes
    # are gathered once a step), and at most one FSDP2 unit's decoded shards are alive at once.
    assert 3 * case["kept_shards"] < case["decoded"] <= 2 * 3 * case["kept_shards"], (where, case)
    assert case["ref_decoded"] == 0, where
    assert 0 < case["decoded_peak"] <= case["largest_unit"] < case["kept_shards"], (where, case)
    # Nothing stays decoded after the steps: no decoded shard alive, every kept weight in its stored form.
    assert case["alive_after"] == 0 and case["kept_after"] == case["kept"], where
    assert case["alive_between"] == 0 and case["kept_between"] == case["kept"], where  # nor between fwd and bwd
    # The step log's figures: the init report's bytes and the decode tracker's peak (reset by the log).
    mib = 2**20
    assert case["step_log"] == {"frozen_held(MiB)": round(case["held"] / mib, 3),
                                "frozen_as_values(MiB)": round(sum(case["frozen_values"].values()) / mib, 3),
                                "frozen_decoded_peak(MiB)": round(case["decoded_peak"] / mib, 3)}, (where, case)
    assert case["step_log"]["frozen_decoded_peak(MiB)"] > 0 and case["peak_after_log"] == 0, (where, case)
    assert case["ref_step_log"] == {}, where  # dequantize: no such fields


def check_merged_export(name: str, export: dict) -> None:
    """merge_lora of a keep run in the release's format, against the release and the dequantize run's bf16 export.

    Every weight no adapter touched is the release's tensor byte for byte (quantized bytes and scales, same
    dtype); each merged weight is bf16, replaces the release's quantized tensor and its scale, is listed in
    modules_to_not_convert, and equals the dequantize run's merged weight bit for bit (the same decoded base and
    the same adapters, merged by the same PEFT delta) and not the base's decoded values (the adapter is in).
    Loaded back, the export holds exactly the bf16 export's values."""
    where = (name, export["modules"])
    assert export["merged"] and export["untouched"] and export["untouched_bytes_equal"], where
    assert export["untouched_dtypes_equal"] and export["merged_dtypes"] == ["torch.bfloat16"], where
    assert export["merged_equal_dequantize"] and export["merged_differs_from_base"], where
    assert export["dropped"] and not set(export["dropped"]) & set(export["untouched"]), where
    assert any(key.endswith(("_scale_inv", ".scale", "_scales")) for key in export["dropped"]), where
    assert {m for m in export["modules_to_not_convert"]} >= set(export["modules"]) and \
        any("experts" in m for m in export["modules"]) and any("attn" in m for m in export["modules"]), where
    assert export["reloaded_equal_bf16"], where
    check_weight_export(name, export["weight_export"])
    if name == "deepseek_fp8":  # the independent oracle, from the adapter the "save" flag wrote
        assert export["attention_oracle"]["checked"] >= 6 and export["attention_oracle"]["mismatched"] == 0, \
            (where, export["attention_oracle"])


def check_weight_export(name: str, export: dict) -> None:
    """strategy.export_weights of the keep run (after the steps, to a plain process outside the group) against the
    files save_merged wrote at the same step: bf16 merged, every tensor and dtype as save_merged(bf16) (the kept
    base decoded, the adapters merged); in the release's format, every tensor as save_merged(release) (the
    release's own bytes and scales, each merged weight in bf16 under the release's key); the adapter alone as
    save_pretrained wrote it; changed_only, the merged weights only. Owners send their rows once, buckets bounded."""
    where = (name, export["figures"]["bf16"]["ranks"][0])
    assert export["bf16_differences"] == [] and export["bf16_keys"] > 20, (where, export["bf16_differences"])
    assert export["release_differences"] == [] and export["release_keys"] > 20, (where, export["release_differences"])
    assert export["modules_equal"], (where, export["figures"]["release"]["modules"])
    # Quantized bytes and scales next to the bf16 merged weights (gpt-oss quantizes only its experts, which the
    # adapters all modify: its release-format export is the bf16 one under the release's keys).
    assert name == "gpt_oss_mxfp4" or len(export["release_stored_dtypes"]) > 2, (where, export["release_stored_dtypes"])
    assert export["changed_differences"] == [] and len(export["changed_keys"]) == export["merged_count"] > 0, where
    assert not any("norm" in key or "embed" in key for key in export["changed_keys"]), export["changed_keys"]
    assert export["adapter_keys"] and all("lora_" in key for key in export["adapter_keys"]), where
    if name == "deepseek_fp8":  # the adapter the "save" flag wrote, at the same step
        assert export["adapter_differences"] == [], (where, export["adapter_differences"])
    bf16 = export["figures"]["bf16"]
    ranks = bf16["ranks"]
    moved = sum(f["bytes_sent"] + f["bytes_kept"] for f in ranks)
    assert bf16["bytes_total"] <= moved <= 1.01 * bf16["bytes_total"], (where, bf16)
    # A rank that is not the destination sends its own rows once (a replicated tensor the destination keeps: not).
    assert all(0 < f["bytes_sent"] <= f["shard_bytes"] and f["bytes_received"] == 0 for f in ranks[1:]), ranks
    for figures in export["figures"].values():
        assert figures["buckets"] == figures["received_buckets"] > 1, (where, figures)
        assert figures["largest_bucket_bytes"] <= max(BUCKET, export["largest_tensor_bytes"]), (where, figures)
        # A sender holds the rows it sends of one bucket (a kept weight's decoded rows), the destination the bucket.
        held = [f["bytes_held"] for f in figures["ranks"]]
        assert held[0] <= 2 * figures["largest_bucket_bytes"] and max(held[1:]) <= figures["largest_bucket_bytes"], \
            (where, held, figures["largest_bucket_bytes"])


def test_lora_over_kept_releases_equals_the_dequantized_run(releases, tmp_path):
    cases = [f"{name}={path}:{family}" for name, path, family in [
        ("deepseek_fp8", releases["deepseek_fp8"], "deepseek_v3+ckpt+save+export"),
        ("deepseek_v4", releases["deepseek_v4"], "deepseek_v4+export"),
        ("gpt_oss_mxfp4", releases["gpt_oss_mxfp4"], "gpt_oss+export"),
        ("refuse", releases["deepseek_fp8"], "refuse"), ("unserved", releases["deepseek_fp8"], "unserved")]]
    result = launch("quantized_keep.py", ["--cases", ",".join(cases), "--save-root", str(tmp_path / "saved")],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=500)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        for name in STORED_DTYPES:
            check_case(name, data["cases"][name], rank)
        fp8 = data["cases"]["deepseek_fp8"]
        check_checkpointed(fp8, rank)
        # Checkpoints: the adapter saved from keep is the one saved from dequantize, bit for bit; a keep run
        # resumed from a checkpoint (adapter and optimizer) takes the next step as the run that went on.
        assert rank != 0 or (fp8["adapter"] is not None and fp8["adapter"] == fp8["ref_adapter"]), rank
        check_resume(fp8["resume"], rank)
        if rank == 0:
            for name in STORED_DTYPES:
                check_merged_export(name, data["cases"][name]["export"])
        kinds = {name: set(data["cases"][name]["frozen_stored"]) for name in STORED_DTYPES}
        assert kinds == {"deepseek_fp8": {"fp8_block"}, "deepseek_v4": {"fp8_block", "fp4_block"},
                         "gpt_oss_mxfp4": {"mxfp4"}}, (rank, kinds)
        check_refusals(data["cases"], rank)
    # Each rank reads its own rows of the adapter and optimizer state: all together, the trainer state once.
    resumes = [data["cases"]["deepseek_fp8"]["resume"] for data in ranks.values()]
    assert sum(r["load_read"] for r in resumes) == resumes[0]["state_tensor_bytes"], resumes


def check_checkpointed(fp8: dict, rank: int) -> None:
    """Activation checkpointing with keep: the same losses, and nothing decoded is stored for the backward. The
    forward frees each unit's decoded weights (FSDP2 reshards it: between the forward and the backward every
    kept weight is in its stored form and no decoded shard is alive); the backward gathers each unit again,
    decoding it anew, and the recomputation runs inside that gather (FSDP2's hooks sit outside the recomputed
    layer), so it costs no decode of its own: the bytes decoded equal the run without checkpointing."""
    checkpointed = fp8["checkpointed"]
    assert checkpointed["losses"] == fp8["losses"], (rank, checkpointed, fp8["losses"])
    assert checkpointed["alive_between"] == 0 and checkpointed["kept_between"] == fp8["kept"], (rank, checkpointed)
    assert checkpointed["decoded"] == fp8["decoded"], (rank, checkpointed["decoded"], fp8["decoded"])
    assert 0 < checkpointed["decoded_peak"] <= checkpointed["largest_unit"], (rank, checkpointed)
    assert checkpointed["alive_after"] == 0 and checkpointed["kept_after"] == fp8["kept"], rank


def check_resume(resume: dict, rank: int) -> None:
    """Resuming a keep run reads the adapter and optimizer state from the checkpoint, which holds no base weight,
    and the base only through the init, which reads what the first run's init read: each node's source its
    node's share as stored, the others nothing."""
    assert resume["resumed"] == resume["continued"], (rank, resume)
    assert resume["base_unchanged"], rank
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in resume["files"]), resume["files"]
    first, again = resume["init_read"]
    assert again == first and resume["init_stored"][0] == resume["init_stored"][1], (rank, resume)
    assert (first > 0) == (rank % 2 == 0), (rank, first)  # 2 ranks a node: ranks 0 and 2 are the sources
    assert resume["release_opened"] == [], (rank, resume["release_opened"])
    assert resume["load_opened"] and all(f.startswith("trainer_state/") for f in resume["load_opened"]), resume
    assert 0 < resume["load_read"] < resume["state_tensor_bytes"], (rank, resume)


def check_refusals(cases: dict, rank: int) -> None:
    """keep's refusals, on every rank, in one line naming the tensor or format and the fix, before any weight
    file is opened for its bytes."""
    refused = cases["refuse"]
    assert refused["error_type"] == "DistributedInitError", (rank, refused)
    error = refused["error"]
    assert "\n" not in error and "quantized_base=keep" in error and "is trainable" in error, error
    assert "quantized_base=dequantize" in error, error
    named = re.search(r"quantized_base=keep: '([^']+)' is stored quantized", error)
    assert named and named[1] in refused["quantized_keys"], (error, refused["quantized_keys"][:4])
    assert refused["release_opened"] == [], (rank, refused["release_opened"])
    unserved = cases["unserved"]  # found by each node's source from the config, raised on every rank
    assert unserved["error_type"] == "DistributedInitError", (rank, unserved)
    assert "\n" not in unserved["error"] and "failed on rank(s) [0, 2]" in unserved["error"], unserved["error"]
    assert "CheckpointError: the checkpoint is quantized with quant_method 'awq'" in unserved["error"], unserved
    assert "set quantized_base=dequantize with stream_checkpoint=False" in unserved["error"], unserved["error"]
    assert unserved["weight_files_opened"] == [], (rank, unserved)


def test_a_kept_weight_decodes_for_reads_and_refuses_writes():
    """One process: a kept region reads as its values (any op), a view shares it, FSDP2's padding protocol
    hands the region over, and an in-place change is refused by name."""
    from twinkle_strategy.dtypes import TensorSpec
    from twinkle_strategy.errors import FrozenWeightError
    from twinkle_strategy.quantized.codec import Codec, StoredAs, quantize_fp8_blocks
    from twinkle_strategy.quantized.kept import KeptRegion, KeptWeight
    from twinkle_strategy.quantized.wire import Piece, WireChunk, WireForm

    torch.manual_seed(0)
    data, scale = quantize_fp8_blocks(torch.randn(20, 32), BLOCK)
    codec = Codec(StoredAs.FP8_BLOCK, (TensorSpec(tuple(data.shape), data.dtype),
                                       TensorSpec(tuple(scale.shape), scale.dtype)), BLOCK, 0)
    convert = lambda pieces, config, rows: {"w": pieces["w"][0][1]}  # noqa: E731
    form = WireForm("w", torch.bfloat16, convert, (WireChunk((0, 20), (Piece("w", "w", (0, 20), codec),)),))
    stored = torch.cat([data.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)])
    kept = KeptWeight.of(KeptRegion("w", form, stored, (20, 32), None))
    want = codec.decode([data, scale]).to(torch.bfloat16)
    assert torch.equal(kept.values(), want) and torch.equal(kept * 2, want * 2)
    assert torch.equal(kept.detach().view(-1).values(), want.view(-1))
    # A weight export's rows (decoding only the chunks they lie in), past the region's end FSDP2's zero padding.
    assert torch.equal(kept.rows(3, 17), want[3:17]) and torch.equal(kept.rows(18, 24)[:2], want[18:])
    assert not kept.rows(18, 24)[2:].any() and kept.rows(18, 24).shape == (6, 32)
    padded = kept.new_zeros((24, 32))
    padded.narrow(0, 0, 20).copy_(kept)
    assert torch.equal(padded.values()[:20], want) and not padded.values()[20:].any()
    with pytest.raises(FrozenWeightError, match="'w' is a frozen weight.*quantized_base=dequantize"):
        kept.add_(1)
    with pytest.raises(FrozenWeightError, match="'w' is a frozen weight"):
        kept.copy_(want)
    assert torch.equal(torch.empty(20, 32, dtype=torch.bfloat16).copy_(kept), want)  # reading it out is fine
    # The receiver's side: the shard in the model's dtype that to_empty allocated is freed as soon as the region
    # is known to be kept, before its stored bytes are allocated (the init never holds both for one region).
    from twinkle_strategy.quantized.kept import KeepingSink

    shard = torch.empty(20, 32, dtype=torch.bfloat16)
    sink = KeepingSink("w", shard, form, None)
    assert shard.untyped_storage().nbytes() == 0 and sink.stored.numel() == stored.numel()
    sink.write(stored[:100])
    sink.write(stored[100:])
    assert torch.equal(KeptWeight.of(sink.region()).values(), want)


def test_lora_over_a_kept_fp8_release_at_two_nodes_of_four(releases, tmp_path):
    """2 nodes x 4, ep=4: three receivers per source, and FSDP2 shards that do not split evenly (the 20-row
    projection over 8 ranks: 3 rows each, the last ranks padded or empty)."""
    case = f"deepseek_fp8={releases['deepseek_fp8']}:deepseek_v3"
    result = launch("quantized_keep.py", ["--cases", case, "--ep", "4", "--save-root", str(tmp_path / "saved")],
                    tmp_path, nnodes=2, nproc_per_node=4, timeout=500)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == list(range(8))
    for rank, data in ranks.items():
        check_case("deepseek_fp8", data["cases"]["deepseek_fp8"], rank)


def test_keep_refusals_of_a_release_it_cannot_hold_name_a_fix_that_keep_accepts():
    """A format the streamed init does not serve, or a release that cannot be streamed, cannot be kept: the fix is
    dequantize with a whole load, not the whole load alone (which keep refuses when the strategy is made)."""
    from transformers import PretrainedConfig

    from twinkle_strategy.distributed.node import NodeTopology
    from twinkle_strategy.errors import CheckpointError
    from twinkle_strategy.loading import open_on_this_rank
    from twinkle_strategy.quantized.formats import quant_format

    awq = PretrainedConfig(quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(CheckpointError, match="'awq'.*quantized_base=dequantize with stream_checkpoint=False"):
        quant_format(awq, quantized_base="keep")
    with pytest.raises(CheckpointError, match=r"'awq'.*load it whole with NativeFSDPStrategy\(\.\.\., stream_check"):
        quant_format(awq)  # dequantize: the whole load is the fix
    unblocked = PretrainedConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    source = NodeTopology(num_nodes=1, local_world_size=1, node_ranks=((0,),), rank=0)
    loaded_whole = []
    with pytest.raises(CheckpointError, match="quantized_base=keep: /release cannot be streamed "
                                              r"\(from_pretrained was given positional arguments\).*dequantize"):
        open_on_this_rank("/release", unblocked, torch.bfloat16, topology=source, stream=True,
                          full_load=lambda: loaded_whole.append(True), quantized_base="keep",
                          blocker="from_pretrained was given positional arguments")
    assert loaded_whole == []
