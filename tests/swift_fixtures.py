"""The swift tier's session fixtures, shared by its test files (a plugin of tests/conftest.py, not a conftest.py of
tests/swift_plugin: a second conftest module would shadow the `from conftest import ...` of other tiers in one
pytest run): ms-swift's virtualenv and the demo model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from twinkle_strategy.train.demo_model import prepare_demo_model

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO / "examples" / "data" / "demo_sft.jsonl"


@pytest.fixture(scope="session")
def swift_bin() -> Path:
    """The bin/ of ms-swift's virtualenv, built (or only checked) by scripts/swift_env.sh: one launch, which also
    prints the env's path (scripts/venv_path.sh) once the check passed."""
    proc = subprocess.run(["bash", "-c", "bash scripts/swift_env.sh >&2 && bash scripts/venv_path.sh swift"], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"scripts/swift_env.sh failed:\n{(proc.stdout + proc.stderr)[-8000:]}"
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """tiny://demo's model with the tokenizer of examples/data/demo_sft.jsonl, as twinkle-sft builds it."""
    path = tmp_path_factory.mktemp("swift_model") / "tiny_qwen3_moe"
    prepare_demo_model(str(path), str(DATASET))
    return path
