"""twinkle-sft's ``tiny://NAME``: the tiny demo model with a tokenizer trained on the recipe's dataset files.

The model is :mod:`twinkle_strategy.sources.tiny`'s (``tiny://demo`` in Python is the same model, its tokenizer
trained on the shipped demo data: :mod:`twinkle_strategy.sources.demo`). The names below that come from there stay
importable from here, as the tests and the fixtures import them.
"""

from __future__ import annotations

import os

from twinkle_strategy.sources.tiny import (  # noqa: F401  (importable from here)
    CHATML_TEMPLATE,
    DEMO_NUM_EXPERTS,
    SPECIAL_TOKENS,
    ConfigBuilder,
    TinySizes,
    build_once,
    build_tokenizer,
    model_from_config,
    prepare_tiny_model,
    qwen3_moe_config,
    save_model,
    sized_config,
)
from twinkle_strategy.train.data import read_rows


def dataset_texts(dataset_paths: str | list[str]) -> list[str]:
    """The message texts of the usable rows of the dataset file(s), in order: what the demo tokenizer learns."""
    texts = []
    for dataset_path in [dataset_paths] if isinstance(dataset_paths, str) else dataset_paths:
        rows, _ = read_rows(dataset_path)  # rows training will skip do not shape the vocabulary either
        texts.extend(m["content"] for _, messages in rows for m in messages if isinstance(m["content"], str))
    return texts


def demo_tokenizer(dataset_paths: str | list[str]):
    """The tokenizer :func:`prepare_demo_model` builds for these datasets (the checks before launch use it too)."""
    return build_tokenizer(dataset_texts(dataset_paths))


def prepare_demo_model(path: str, dataset_paths: str | list[str], seed: int = 0,
                       build_config: ConfigBuilder = qwen3_moe_config, **sizes) -> str:
    """The embedded default: a tiny model (``build_config``'s family) with a tokenizer trained on the dataset file(s),
    written once to ``path`` (:func:`twinkle_strategy.sources.tiny.prepare_tiny_model`); later calls reuse it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path  # built: the data is not read again
    return prepare_tiny_model(path, dataset_texts(dataset_paths), seed, build_config, **sizes)
