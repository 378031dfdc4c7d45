"""The demo for one's own first script: a tiny, real Qwen3-MoE checkpoint and the conversations it learns.

``NativeFSDPStrategy.from_pretrained("tiny://demo")`` (or :func:`demo_model_path`) gives a model that trains on a
laptop's CPU in seconds, with the files and classes of a released one (config.json, safetensors in the hub
layout, a tokenizer with a chat template): the transformers Qwen3-MoE classes with every size shrunk, and a
byte-level BPE tokenizer trained on :func:`demo_conversations`. It is built once per machine, under
:func:`demo_cache_dir`, and reused by every later call and process.

The conversations are TRL's conversational format (``{"messages": [{"role": ..., "content": ...}, ...]}``),
which ``datasets.load_dataset("json", ...)``, TRL's ``SFTTrainer``, ``twinkle-sft`` and ``swift sft`` all take;
the repository ships them as ``examples/data/demo_sft.jsonl`` (:func:`write_demo_dataset` writes that file).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile

from twinkle_strategy import __version__
from twinkle_strategy.sources.tiny import prepare_tiny_model

DEMO_MODEL_ID = "tiny://demo"

_COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red"}
_CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
             "Peru": "Lima", "Kenya": "Nairobi", "Chile": "Santiago"}
_WORDS = ["cat", "dog", "tree", "moon", "river", "stone", "bird", "fish"]


def _questions(rng: random.Random):
    for _ in range(120):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        yield f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    for thing, color in _COLORS.items():
        for _ in range(4):
            yield f"What color is the {thing}?", f"The {thing} is {color}."
    for country, city in _CAPITALS.items():
        for _ in range(4):
            yield f"What is the capital of {country}?", f"The capital of {country} is {city}."
    for _ in range(60):
        word = rng.choice(_WORDS)
        yield f"Spell the word {word}.", " ".join(word.upper()) + "."


def demo_conversations() -> list[dict]:
    """The demo's 236 rows, ``{"messages": [user, assistant]}`` each, in a fixed order (seeded)."""
    rng = random.Random(0)
    pairs = list(_questions(rng))
    rng.shuffle(pairs)
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]


def demo_dataset_text() -> str:
    """:func:`demo_conversations` as JSONL, one row a line."""
    return "".join(json.dumps(row) + "\n" for row in demo_conversations())


def write_demo_dataset(path: str) -> str:
    """Write the demo's JSONL to ``path`` (complete or not at all: written beside it and renamed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".demo-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(demo_dataset_text())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def demo_cache_dir() -> str:
    """Where the demo is built: ``$TWINKLE_CACHE`` or ``~/.cache/twinkle_strategy`` (``$XDG_CACHE_HOME``
    honoured), then a directory named by this package's version and the data, so a changed demo is rebuilt."""
    root = os.environ.get("TWINKLE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "twinkle_strategy")
    key = hashlib.sha1(f"{__version__}\n{demo_dataset_text()}".encode()).hexdigest()[:12]
    return os.path.join(root, f"demo-{key}")


def demo_dataset_path() -> str:
    """The demo's JSONL in :func:`demo_cache_dir` (written on first use), for ``load_dataset("json", ...)``."""
    path = os.path.join(demo_cache_dir(), "demo_sft.jsonl")
    if not os.path.isfile(path):
        write_demo_dataset(path)
    return path


def demo_model_path() -> str:
    """The local directory of ``tiny://demo``, built on first use (a few seconds) and reused afterwards.

    Safe to call from every rank at once: each builds into a temporary directory and the first rename wins.
    """
    texts = [m["content"] for row in demo_conversations() for m in row["messages"]]
    return prepare_tiny_model(os.path.join(demo_cache_dir(), "model"), texts)
