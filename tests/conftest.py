import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from twinkle_strategy.tiny_models import FAMILIES, save_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Real safetensors checkpoints of the four tiny MoE families, built once per test session."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    for family in FAMILIES:
        save_tiny_checkpoint(family, str(root / family), seed=0)
    # Tied input/output embeddings: must stay one tensor after init.
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe_tied"), seed=1, tie_word_embeddings=True)
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
