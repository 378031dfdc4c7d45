"""Tiny, real vision-language MoE checkpoints with a real processor, and a tiny image-text dataset.

For image-text fine-tuning through ``swift sft`` (examples/swift_vl_sft.sh, tests/swift_plugin/test_swift.py):
swift's templates turn each ``<image>`` of a sample into the model's vision tokens and run the
checkpoint's own processor on the image, so the checkpoint needs a processor that really
processes images (``Qwen3VLProcessor``: image processor, video processor, tokenizer).

swift's Qwen-VL templates expand the image placeholder by a fixed token id (Qwen3-VL's 151655,
Qwen3.5's 248056), so the tiny tokenizer keeps the vision tokens at the ids the released
tokenizers (and the model configs' defaults) give them; the vocabulary, and so the embedding,
reaches that far. Everything else is tiny: a BPE trained on the dataset, a one-block vision tower
with 4-pixel patches, 32x32 images.
"""

from __future__ import annotations

import json
import os

from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.sources.tiny import build_once, build_tokenizer
from twinkle_strategy.testing.families import VISION_LANGUAGE_FAMILIES
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint, tiny_config

# The config attribute holding each vision token's id, and the token's text (as in Qwen's tokenizers).
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# Generated demo images: (file stem, RGB colour, shape); the answer names colour and shape, so the
# loss only goes down where the model looks at the image.
DEMO_IMAGES = [("red_square", (220, 30, 30), "square"), ("green_square", (30, 190, 60), "square"),
               ("blue_circle", (40, 70, 220), "circle"), ("yellow_circle", (230, 210, 40), "circle"),
               ("red_circle", (220, 30, 30), "circle"), ("blue_square", (40, 70, 220), "square"),
               ("green_circle", (30, 190, 60), "circle"), ("yellow_square", (230, 210, 40), "square")]
DEMO_IMAGE_SIZE = 32
DEMO_QUESTIONS = ["<image>What is in this picture?", "Describe the shape and its colour.<image>"]


def vision_token_ids(config) -> dict[str, int]:
    """The vision tokens' texts and ids as the vision-language ``config`` expects them."""
    return {text: getattr(config, attr) for attr, text in VISION_TOKENS.items()}


def build_vl_tokenizer(texts: list[str], token_ids: dict[str, int]):
    """The demo's tiny ChatML BPE tokenizer (:mod:`twinkle_strategy.train.demo_model`) plus the vision tokens at ``token_ids``.

    The ids are far beyond the BPE's vocabulary: they are written into the tokenizer's vocabulary
    as they are (``tokenizers`` allows gaps), as special tokens so that text never splits them.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(texts)
    spec = json.loads(base.backend_tokenizer.to_str())
    for text, token_id in token_ids.items():
        spec["model"]["vocab"][text] = token_id
        spec["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                        eos_token=base.eos_token, pad_token=base.pad_token)
    tokenizer.chat_template = base.chat_template
    return tokenizer


def build_vl_processor(tokenizer, vision_config):
    """``Qwen3VLProcessor`` (image + video processors and ``tokenizer``) for the tiny vision tower."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    sizes = dict(patch_size=vision_config.patch_size, temporal_patch_size=vision_config.temporal_patch_size,
                 merge_size=vision_config.spatial_merge_size)
    factor = vision_config.patch_size * vision_config.spatial_merge_size
    size = {"shortest_edge": 4 * factor * factor, "longest_edge": 256 * factor * factor}
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(size=size, **sizes), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(size=size, **sizes),
                            chat_template=tokenizer.chat_template)


def _draw(colour: tuple[int, int, int], shape: str):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE), (255, 255, 255))
    box = (6, 6, DEMO_IMAGE_SIZE - 7, DEMO_IMAGE_SIZE - 7)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=colour)
    return image


def write_vl_demo_dataset(directory: str) -> str:
    """Writes the demo PNGs and ``vl_sft.jsonl`` (swift's format: ``<image>`` in the user message, an
    ``images`` list of absolute paths) under ``directory``; returns the JSONL's path. Idempotent."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "vl_sft.jsonl")
    rows = []
    for i, (stem, colour, shape) in enumerate(DEMO_IMAGES):
        image_path = os.path.abspath(os.path.join(directory, f"{stem}.png"))
        if not os.path.exists(image_path):
            _draw(colour, shape).save(image_path)
        answer = f"A {stem.split('_')[0]} {shape}."
        rows.append({"messages": [{"role": "user", "content": DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]},
                                  {"role": "assistant", "content": answer}], "images": [image_path]})
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)
    return path


def _dataset_texts(dataset_path: str) -> list[str]:
    with open(dataset_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [m["content"].replace("<image>", " ") for row in rows for m in row["messages"]] + ["<think>\n\n</think>\n\n"]


def prepare_vl_demo_model(path: str, dataset_path: str, family: str = "qwen3_vl_moe", seed: int = 0,
                          **sizes) -> str:
    """A tiny ``family`` (``qwen3_vl_moe`` or ``qwen3_5_moe_vl``) checkpoint saved from its vision-language
    class, with its processor and a tokenizer trained on ``dataset_path``'s texts. Written once to
    ``path`` (through a temporary directory, so an interrupted build leaves nothing half-written)."""
    if family not in VISION_LANGUAGE_FAMILIES:
        raise ArgumentError(f"prepare_vl_demo_model: family {family!r} is not vision-language; "
                         f"choose one of {VISION_LANGUAGE_FAMILIES}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    token_ids = vision_token_ids(tiny_config(family))
    tokenizer = build_vl_tokenizer(_dataset_texts(dataset_path), token_ids)
    vocab_size = (max(token_ids.values()) // 64 + 1) * 64  # the embedding must reach the vision tokens' ids

    def build(tmp: str) -> None:
        from transformers import AutoConfig

        save_tiny_checkpoint(family, tmp, seed=seed, vocab_size=vocab_size, **sizes,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        build_vl_processor(tokenizer, AutoConfig.from_pretrained(tmp).vision_config).save_pretrained(tmp)

    return build_once(path, build)
