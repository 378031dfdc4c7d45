import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Folder -> marker. The swift tier's folder is not `swift/` (nor the vllm tier's `vllm/`): this folder is on sys.path (above), and a `swift/`
# in it would shadow ms-swift's own `swift` package (vLLM's `vllm`) for every test that imports it.
TIERS = {"unit": "unit", "multiproc": "multiproc", "swift_plugin": "swift", "vllm_engine": "vllm"}


def pytest_collection_modifyitems(items):
    """Mark every test with its tier, the folder it lives in (pyproject.toml registers the markers): `-m unit`."""
    for item in items:
        tier = TIERS.get(item.path.parent.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))

from twinkle_strategy.testing.families import FAMILIES, LAYOUT_FAMILIES  # noqa: E402
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint  # noqa: E402

# Checkpoints split into several files (with model.safetensors.index.json): a few tensors per file.
SHARD = "40KB"
# Directory name -> (family, extra arguments): what the streaming tests load, in the hub layout transformers writes.
LAYOUT_CHECKPOINTS = {
    "deepseek_v4": ("deepseek_v4", {}),
    "qwen3_5_moe_vl": ("qwen3_5_moe_vl", {}),
    "mixtral_sharded": ("mixtral", {"max_shard_size": SHARD}),
    "qwen2_moe_tied_sharded": ("qwen2_moe", {"max_shard_size": SHARD, "tie_word_embeddings": True}),
    "deepseek_v4_sharded": ("deepseek_v4", {"max_shard_size": SHARD}),
    "qwen3_5_moe_vl_sharded": ("qwen3_5_moe_vl", {"max_shard_size": SHARD}),
    # (2I != H: its hub layout stores experts transposed, and transformers tells the two apart by shape)
    "qwen3_vl_moe": ("qwen3_vl_moe", {"intermediate_size": 8}),
}
assert {family for family, _ in LAYOUT_CHECKPOINTS.values()} >= set(LAYOUT_FAMILIES)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Real safetensors checkpoints of the tiny MoE families, built once per test session."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    for family in FAMILIES:
        save_tiny_checkpoint(family, str(root / family), seed=0)
    # Tied input/output embeddings: must stay one tensor after init.
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe_tied"), seed=1, tie_word_embeddings=True)
    for name, (family, kwargs) in LAYOUT_CHECKPOINTS.items():
        save_tiny_checkpoint(family, str(root / name), seed=2, **kwargs)
    return root


@pytest.fixture(scope="session")
def wrong_shape_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint with one tensor of the wrong shape."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("wrong_shape") / "qwen3_moe"
    shutil.copytree(tiny_checkpoints / "qwen3_moe", path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.1.mlp.gate.weight"] = torch.zeros(3, 3)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
