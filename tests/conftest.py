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
    return root
