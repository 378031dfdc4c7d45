"""Tiny quantized hub releases, written as the real ones ship: FP8 blocks (DeepSeek-V3, Qwen3 "-FP8"),
DeepSeek-V4-Flash (FP8 dense, FP4 experts) and gpt-oss (MXFP4 experts).

For the tests of :mod:`twinkle_strategy.quantized.formats` (and :mod:`~twinkle_strategy.quantized.codec`) and benchmarks/quant_bench.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import torch
from safetensors.torch import load_file, save_file

from twinkle_strategy.quantized.codec import quantize_fp4_groups, quantize_fp8_blocks, quantize_mxfp4
from twinkle_strategy.testing.tiny_models import build_tiny_model

# Checkpoint keys that quantized releases store in FP8 (attention and MLP projections, experts included);
# embeddings, norms, routers and lm_head stay as they are.
_QUANTIZED_KEY = re.compile(r"(proj|proj_with_mqa|\.w[a-z0-9_]*)\.weight$")


def save_tiny_quantized_checkpoint(family: str, path: str, block: tuple[int, int] = (16, 16), seed: int = 0,
                                   scale_dtype: torch.dtype = torch.float32, files: int = 4,
                                   dtype: torch.dtype = torch.bfloat16, **config_kwargs) -> str:
    """A tiny ``family`` checkpoint laid out as its FP8 hub releases (DeepSeek-V3, Qwen3 "-FP8"): every
    projection weight float8_e4m3fn with a per-block ``weight_scale_inv`` (``scale_dtype``), the rest as
    trained, in ``files`` files (a weight and its scale often in different files) with an index."""
    config, tensors = _hub_tensors(family, seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        if value.dim() == 2 and _QUANTIZED_KEY.search(key):
            out[key], scale = quantize_fp8_blocks(value, block)
            out[key + "_scale_inv"] = scale.to(scale_dtype)
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block))
    return _write_release(path, config, out, files)


def _hub_tensors(family: str, seed: int, dtype: torch.dtype, **config_kwargs) -> tuple:
    """The config and the checkpoint tensors (hub keys, as ``save_pretrained`` writes them) of a tiny model."""
    model = build_tiny_model(family, seed=seed, dtype=dtype, **config_kwargs)
    with tempfile.TemporaryDirectory(prefix="twinkle-release-") as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        return model.config, load_file(os.path.join(scratch, "model.safetensors"))


def _write_release(path: str, config, tensors: dict, files: int) -> str:
    """``tensors`` in ``files`` safetensors files, dealt round-robin in key order, with an index, and config.json."""
    os.makedirs(path, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    keys = sorted(tensors)
    weight_map = {key: names[i % files] for i, key in enumerate(keys)}
    for name in names:
        part = {k: tensors[k].contiguous() for k in keys if weight_map[k] == name}
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(path)
    return path


def save_tiny_deepseek_v4_release(path: str, block: tuple[int, int] = (16, 16), seed: int = 0, files: int = 4,
                                  dtype: torch.dtype = torch.bfloat16, **config_kwargs) -> str:
    """A tiny DeepSeek-V4 checkpoint laid out as DeepSeek-V4-Flash ships: keys without ``model.``, dense
    projections FP8 with a ue8m0 ``.scale`` per block, routed experts FP4 (int8 bytes, two e2m1 values each,
    low nibble first, ``[out, in / 2]``) with a ue8m0 ``.scale`` ``[out, in / 32]``."""
    config, tensors = _hub_tensors("deepseek_v4", seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        key = _v4_release_key(key)
        if value.dim() == 2 and _QUANTIZED_KEY.search(key):
            stem = key[:-len("weight")]
            routed = ".experts." in key
            out[key], out[stem + "scale"] = (quantize_fp4_groups(value) if routed
                                             else quantize_fp8_blocks(value, block, ue8m0=True))
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block), scale_fmt="ue8m0")
    config.expert_dtype = "fp4"
    return _write_release(path, config, out, files)


def _v4_release_key(key: str) -> str:
    """DeepSeek-V4-Flash's own names: no ``model.`` prefix, ``embed`` and ``hc_head_*`` at the top."""
    key = key.removeprefix("model.")
    key = re.sub(r"^embed_tokens\.", "embed.", key)
    return re.sub(r"^hc_head\.hc_", "hc_head_", key)


def save_tiny_mxfp4_release(path: str, seed: int = 0, files: int = 4, dtype: torch.dtype = torch.bfloat16,
                            **config_kwargs) -> str:
    """A tiny gpt-oss checkpoint laid out as gpt-oss ships: experts MXFP4 (``*_blocks`` uint8
    ``[E, out, in / 32, 16]`` and ``*_scales`` uint8 exponents ``[E, out, in / 32]``), the rest bf16."""
    config, tensors = _hub_tensors("gpt_oss", seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[key + "_blocks"], out[key + "_scales"] = quantize_mxfp4(value)
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])
    return _write_release(path, config, out, files)
