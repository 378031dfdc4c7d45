"""Quantized hub releases (FP8 blocks, DeepSeek-V4 FP8/FP4, MXFP4): the format math in one process, and the
streamed init on 2 nodes x 2 ranks, ep=2, against plain from_pretrained and the formats' definitions."""

import json
import math

import pytest
import torch
from multinode import launch

from twinkle_strategy.checkpoint.reading import SafetensorsIndex
from twinkle_strategy.errors import CheckpointError
from twinkle_strategy.quantized.codec import apply_block_scales, quantize_fp4_groups, quantize_fp8_blocks, unpack_e2m1
from twinkle_strategy.quantized.formats import QuantFormat, QuantizedIndex, quant_format
from twinkle_strategy.testing.releases import (
    save_tiny_deepseek_v4_release,
    save_tiny_mxfp4_release,
    save_tiny_quantized_checkpoint,
)

BLOCK = (16, 16)
# Qwen3-MoE with 6 heads (q_proj rows 96: each of 4 FSDP ranks gets 24, across 16-row blocks), a dense
# first layer, bf16 scales as Qwen3 "-FP8" ships them.
QWEN3 = dict(hidden_size=64, intermediate_size=32, num_attention_heads=6, mlp_only_layers=[0],
             scale_dtype=torch.bfloat16)
# DeepSeek-V3 with every projection a multiple of 16 (q_b_proj rows 80: 20 per rank, across blocks).
DEEPSEEK = dict(hidden_size=64, intermediate_size=32, qk_rope_head_dim=16, qk_head_dim=20, head_dim=16)
# DeepSeek-V3 as released in shape: kv_a_proj_with_mqa has 16 + 4 = 20 rows, a ragged last block
# (DeepSeek-V3's own is [576, 7168] over 128-blocks: 4.5 blocks of rows).
RAGGED = dict(hidden_size=64, intermediate_size=32)
# DeepSeek-V4-Flash's layout (FP8 dense, FP4 experts) and gpt-oss MXFP4 need inputs that are multiples of 32.
V4 = dict(hidden_size=64, intermediate_size=32)
GPT_OSS = dict(hidden_size=64, intermediate_size=32)
TRUNCATED_SCALE = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
MISSING_SCALE = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"


def definition(weight, scale, block):
    """w[i, j] * s[i // B0, j // B1], one value at a time."""
    out = torch.empty(weight.shape)
    for i in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            out[i, j] = float(weight[i, j]) * float(scale[i // block[0], j // block[1]])
    return out


# ------------------------------------------------------- the formats' definitions, written independently
def e2m1_by_bits(nibbles: torch.Tensor) -> torch.Tensor:
    """An e2m1 value from its bits: sign, two exponent bits (bias 1), one mantissa bit; exponent 0 is subnormal."""
    sign = torch.where((nibbles & 8) > 0, -1.0, 1.0).double()
    exponent, mantissa = ((nibbles >> 1) & 3).double(), (nibbles & 1).double()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.pow(2.0, exponent - 1) * (1 + mantissa / 2))
    return sign * magnitude


def nibbles_low_first(packed: torch.Tensor) -> torch.Tensor:
    u8 = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([u8 % 16, u8 // 16], dim=-1).flatten(-2)


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).double() - 127)


def reference_fp4(packed, scale):
    """DeepSeek-V4 FP4 expert: [out, in / 2] bytes, low nibble first, times 2 ** (e - 127) per 32 of a row."""
    values = e2m1_by_bits(nibbles_low_first(packed))
    return (values * ue8m0(scale).repeat_interleave(32, dim=1)).float()


def reference_mxfp4(blocks, scales):
    """gpt-oss MXFP4: [E, out, G, 16] bytes times 2 ** (scale - 127) per group of 32, laid out [E, in, out]."""
    values = e2m1_by_bits(nibbles_low_first(blocks)) * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2).float().contiguous()


def reference_fp8(weight, scale, block):
    values = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    return definition_blocks(weight, ue8m0(values) if scale.dtype == torch.float8_e8m0fnu else values, block)


def definition_blocks(weight, scale, block):
    """w[i, j] * s[i // B0, j // B1], block by block; edge blocks are what is left."""
    out = torch.empty(weight.shape)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            rows, cols = slice(bi * block[0], (bi + 1) * block[0]), slice(bj * block[1], (bj + 1) * block[1])
            out[rows, cols] = (weight[rows, cols].double() * float(scale[bi, bj])).float()
    return out


def write_reference(release: str, block) -> str:
    """``release`` dequantized by the definitions above, as a plain checkpoint beside it (``.reference``):
    quantized weights as float32 values (so from_pretrained casts them as it casts any weight), the rest as is."""
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for file in sorted(os.listdir(release)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(release, file), "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for key, value in tensors.items():
        stem = key.removesuffix("weight")
        if key + "_scale_inv" in tensors:
            out[key] = reference_fp8(value, tensors[key + "_scale_inv"], block)
        elif key.endswith(".weight") and stem + "scale" in tensors:
            scale = tensors[stem + "scale"]
            out[key] = reference_fp4(value, scale) if value.dtype == torch.int8 else reference_fp8(value, scale, block)
        elif key.endswith("_blocks"):
            out[key.removesuffix("_blocks")] = reference_mxfp4(value, tensors[key.removesuffix("_blocks") + "_scales"])
        elif not key.endswith(("_scale_inv", "_scales")) and not (key.endswith(".scale") and key[:-5] + "weight"
                                                                    in tensors):
            out[key] = value
    path = release + ".reference"
    os.makedirs(path)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(release, "config.json")).read())
    del config["quantization_config"]
    open(os.path.join(path, "config.json"), "w").write(json.dumps(config))
    return path


def test_reference_definitions_agree_with_the_library():
    """The test's definitions and the library's vectorised math agree, for FP4 and MXFP4 too."""
    from twinkle_strategy.quantized.codec import mxfp4_values, quantize_mxfp4

    torch.manual_seed(0)
    packed, scale = quantize_fp4_groups(torch.randn(4, 64))
    assert torch.equal(reference_fp4(packed, scale), apply_block_scales(unpack_e2m1(packed), scale, (1, 32)))
    blocks, scales = quantize_mxfp4(torch.randn(2, 64, 8))
    assert blocks.shape == (2, 8, 2, 16) and scales.shape == (2, 8, 2)
    assert torch.equal(reference_mxfp4(blocks, scales), mxfp4_values(blocks, scales))
    assert e2m1_by_bits(torch.arange(16)).tolist() == [abs(v) if i < 8 else -abs(v) for i, v in
                                                       enumerate([0, .5, 1, 1.5, 2, 3, 4, 6] * 2)]


# ------------------------------------------------------------------------------------------ the math
@pytest.mark.parametrize("shape,block", [((32, 48), (16, 16)), ((20, 40), (16, 16)), ((576 // 16, 7), (8, 4))])
def test_fp8_block_dequantization_is_the_definition_for_any_rows(shape, block):
    torch.manual_seed(0)
    weight, scale = quantize_fp8_blocks(torch.randn(shape), block)
    assert scale.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    want = definition(weight, scale, block)
    assert torch.equal(apply_block_scales(weight, scale, block), want)
    for a, b in [(3, 11), (block[0] - 1, shape[0]), (block[0], block[0] + 1)]:
        rows = scale[a // block[0]:math.ceil(b / block[0])]  # only the scale rows those rows need
        assert torch.equal(apply_block_scales(weight[a:b], rows, block, first_row=a), want[a:b]), (a, b)


def test_fp8_quantization_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    q, s = quantize_fp8_blocks(weight, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.allclose(apply_block_scales(q, s, (16, 16)), weight, rtol=0.07, atol=1e-6)


def test_e2m1_unpacks_low_nibble_first_and_ue8m0_is_a_power_of_two():
    packed = torch.tensor([[0x71, 0xF8]], dtype=torch.uint8).view(torch.int8)  # nibbles 1, 7 | 8, 15
    assert unpack_e2m1(packed).tolist() == [[0.5, 6.0, -0.0, -6.0]]
    weight = torch.tensor([[0.5 * 2.0 ** -3, -1.5 * 2.0 ** -3] * 16, [3.0 * 2.0 ** 4, 6.0 * 2.0 ** 4] * 16])
    data, scale = quantize_fp4_groups(weight)  # one power-of-two scale per row of 32 values
    assert data.dtype == torch.int8 and data.shape == (2, 16) and scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(apply_block_scales(unpack_e2m1(data), scale, (1, 32)), weight)


def test_served_formats_and_refused_ones_by_name():
    config = type("C", (), {})()
    assert quant_format(config) is None
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert quant_format(config) == QuantFormat("fp8", (128, 128))
    config.quantization_config = {"quant_method": "mxfp4"}
    assert quant_format(config) == QuantFormat("mxfp4", None)
    config.quantization_config = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CheckpointError, match="quant_method 'awq'.*stream_checkpoint=False"):
        quant_format(config)
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": None}
    with pytest.raises(CheckpointError, match="weight_block_size None"):
        quant_format(config)


# ------------------------------------------------------------------------------------------ releases
@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    paths = {
        "qwen3_fp8": save_tiny_quantized_checkpoint("qwen3_moe", str(root / "qwen3_fp8"), BLOCK, **QWEN3),
        "deepseek_fp8": save_tiny_quantized_checkpoint("deepseek_v3", str(root / "deepseek_fp8"), BLOCK, **DEEPSEEK),
        "deepseek_ragged": save_tiny_quantized_checkpoint("deepseek_v3", str(root / "ragged"), BLOCK, **RAGGED),
        "deepseek_v4": save_tiny_deepseek_v4_release(str(root / "deepseek_v4"), BLOCK, **V4),
        "gpt_oss_mxfp4": save_tiny_mxfp4_release(str(root / "gpt_oss_mxfp4"), **GPT_OSS),
        # zero-computation experts: ep rank 1 keeps two runs of expert slots, sent as stored
        "longcat_fp8": save_tiny_quantized_checkpoint("longcat_flash", str(root / "longcat_fp8"), BLOCK),
    }
    for name in ("deepseek_ragged", "deepseek_v4", "gpt_oss_mxfp4", "longcat_fp8"):
        write_reference(paths[name], BLOCK)
    paths["truncated_scale"] = _broken(paths["deepseek_fp8"], root / "truncated_scale", TRUNCATED_SCALE,
                                       lambda t: t[:-1])
    paths["missing_scale"] = _broken(paths["qwen3_fp8"], root / "missing_scale", MISSING_SCALE, None)
    return paths


def _broken(good: str, path, key: str, change) -> str:
    """A copy of ``good`` whose scale ``key`` is changed (None: removed, from its file and the index)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(good, path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file = path / index["weight_map"][key]
    tensors = load_file(str(file))
    if change is None:
        del tensors[key], index["weight_map"][key]
        index_file.write_text(json.dumps(index))
    else:
        tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    return str(path)


def test_release_layout_is_as_shipped(releases):
    """FP8 projections with per-block scales, a scale in another file than its weight; the ragged
    DeepSeek projection has the 2-row grid that makes transformers infer a wrong block of 10 rows."""
    index = SafetensorsIndex.from_directory(releases["deepseek_ragged"])
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert index.tensors[key].dtype == torch.float8_e4m3fn and index.tensors[key].shape == (20, 64)
    assert index.tensors[key + "_scale_inv"].shape == (2, 4)
    assert index.tensors[key].file != index.tensors[key + "_scale_inv"].file
    assert index.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    # The router is not quantized: it stays in the dtype from_pretrained(dtype=bf16) gives it (bf16, or fp32
    # where the installed transformers keeps DeepSeek-V3's router weight in fp32, as 5.24 does), with no scale.
    router = "model.layers.1.mlp.gate.weight"
    assert index.tensors[router].dtype in (torch.bfloat16, torch.float32) and router + "_scale_inv" not in index.tensors
    logical = QuantizedIndex(index, QuantFormat("fp8", BLOCK))
    assert key + "_scale_inv" not in logical and logical.tensors[key].dtype == torch.float32


@pytest.mark.parametrize("name,key,rows", [
    ("deepseek_fp8", "model.layers.0.self_attn.q_b_proj.weight", (7, 75)),  # rows across five 16-row blocks
    ("deepseek_ragged", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (3, 20)),  # the ragged edge
    ("qwen3_fp8", "model.layers.1.mlp.experts.gate_up_proj", (2, 7)),  # experts 2..6, gate and up each
    ("deepseek_v4", "model.layers.1.mlp.experts.down_proj", (1, 8)),  # FP4 experts
    ("gpt_oss_mxfp4", "model.layers.0.mlp.experts.gate_up_proj", (3, 5)),  # MXFP4, transposed
    # LongCat-Flash: ep rank 1 of 2 keeps routed experts 4..7 and zero-computation slots 10..11
    ("longcat_fp8", "model.layers.1.mlp.experts.gate_up_proj", [(4, 8), (10, 12)]),
])
def test_a_region_sent_as_stored_decodes_to_the_values_read_here(releases, name, key, rows):
    """Any rows, in chunks small enough to cut them several times: the receiver's decoding of the bytes the
    source sends equals the source's own reading, and no scale row is sent twice."""
    from twinkle_strategy.init.skeleton import CheckpointTensor
    from twinkle_strategy.init.streams import as_bytes
    from twinkle_strategy.loading import load_config, open_streaming_model
    from twinkle_strategy.quantized.wire import plan_wire_form, read_chunks

    model = open_streaming_model(releases[name], load_config(releases[name]), torch.bfloat16)
    layout = next(t.checkpoint for t in model.parameters() if isinstance(t, CheckpointTensor))
    runs = [rows] if isinstance(rows[0], int) else rows
    form = plan_wire_form(layout, key, runs, chunk_bytes=600)
    assert form is not None and len(form.chunks) > 1
    data = torch.cat([as_bytes(chunk) for chunk in read_chunks(layout, form)])
    assert data.numel() == form.nbytes
    values, at = [], 0
    for chunk in form.chunks:
        values.append(form.decode(chunk, data[at:at + chunk.nbytes], model.config))
        at += chunk.nbytes
    assert torch.equal(torch.cat(values), torch.cat([layout.read_rows(key, run) for run in runs]))
    scale_rows = [(piece.key, r) for chunk in form.chunks for piece in chunk.pieces if piece.codec and piece.rows
                  for r in range(piece.rows[0] // piece.codec.block[0], math.ceil(piece.rows[1] / piece.codec.block[0]))]
    assert len(scale_rows) == len(set(scale_rows))


def test_fp8_releases_stream_to_every_rank(releases, tmp_path):
    """2 nodes x 2, ep=2: bit for bit equal to plain from_pretrained (or to the definition on ragged edges),
    each source reading about its node's half of the files, each receiver getting the FP8 bytes and the
    scale rows its shards need; a broken scale is named on every rank."""
    cases = [f"{name}={releases[name]}:{oracle}" for name, oracle in [
        ("qwen3_fp8", "transformers+save"), ("deepseek_fp8", "transformers"), ("deepseek_ragged", "reference"),
        ("deepseek_v4", "reference+verify"), ("gpt_oss_mxfp4", "reference+verify"),
        ("longcat_fp8", "reference"),  # its MLA kv_a_proj_with_mqa has a ragged last block, like DeepSeek's
        ("truncated_scale", "error"), ("missing_scale", "error")]]
    result = launch("quantized.py", ["--cases", ",".join(cases), "--block", "16,16", "--save-root",
                                     str(tmp_path / "saved")], tmp_path,
                    nnodes=2, nproc_per_node=2, timeout=400)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        for name in ("qwen3_fp8", "deepseek_fp8", "deepseek_ragged", "deepseek_v4", "gpt_oss_mxfp4", "longcat_fp8"):
            case = data["cases"][name]
            assert case["mismatches"] == [], (rank, name, case["mismatches"])
            assert not case["has_quantization_config"]
            if case["is_source"]:
                # (verify_init reads the node's rows a second time, for its checksums)
                assert case["read_ratio"] <= (2.1 if case["verified"] else 1.05), (rank, name, case["read_ratio"])
                assert case["sent"] < 0.75 * case["sent_decoded"], (rank, name, case["log_line"])
            else:
                if case["stored_bound"] is not None:  # FP8 releases: exactly the stored rows and scale rows
                    assert case["received"] <= case["stored_bound"], (rank, name, case["received"],
                                                                      case["stored_bound"])
                assert case["received_decoded"] == case["shard_bytes"] + case["buffer_bytes"]
                assert case["received"] < 0.75 * case["received_decoded"], (rank, name, case["log_line"])
    # A full-parameter save from the FP8 start is a plain bf16 checkpoint that plain from_pretrained loads.
    saved = ranks[0]["cases"]["qwen3_fp8"]
    assert saved["saved_dtypes"] == ["torch.bfloat16"] and not saved["saved_has_quantization_config"]
    assert saved["saved_mismatches"] == []
    for rank, data in ranks.items():
        for name, key in [("truncated_scale", TRUNCATED_SCALE), ("missing_scale", MISSING_SCALE)]:
            case = data["cases"][name]
            assert case["error_type"] == "DistributedInitError", (rank, name, case)
            assert f"'{key}'" in case["error"], (rank, name, case["error"])
