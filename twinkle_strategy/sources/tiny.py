"""Tiny, real checkpoints: a family's config with every size shrunk, a tokenizer trained on given texts.

The demo's config uses the transformers Qwen3-MoE classes with every size shrunk, and
``save_pretrained`` writes a real safetensors checkpoint: the same files ``from_pretrained``
reads for a 30B model. :mod:`twinkle_strategy.sources.demo` (``tiny://demo``) and twinkle-sft's ``tiny://``
(``train/demo_model.py``, the tokenizer trained on the recipe's data) build theirs with :func:`prepare_tiny_model`.
Tiny checkpoints of every other family, quantized releases and the test matrices are fixtures:
:mod:`twinkle_strategy.testing`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from twinkle_strategy.loading import model_class_for

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


@dataclasses.dataclass(frozen=True)
class TinySizes:
    """The sizes a tiny config is shrunk to; each family's config builder adds what it calls its own."""

    vocab: int = 128
    experts: int = 8
    hidden: int = 32
    inter: int = 16  # the expert intermediate size
    layers: int = 2

    @property
    def common(self) -> dict:
        """The config attributes every family shares."""
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            # A wide init makes router scores far apart, so top-k choices do not
            # flip on last-bit differences between a sharded and a single-process run.
            initializer_range=0.2,
            tie_word_embeddings=False,
        )

    @property
    def heads(self) -> dict:
        return dict(head_dim=self.hidden // 4)


# A family's tiny config from the sizes (twinkle_strategy.testing.tiny_models.TINY_CONFIGS has one per family).
ConfigBuilder = Callable[[TinySizes], "PretrainedConfig"]


def qwen3_moe_config(s: TinySizes) -> PretrainedConfig:
    """The demo's family: Qwen3-MoE, every layer MoE."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **s.common, **s.heads, num_hidden_layers=s.layers, intermediate_size=2 * s.inter,
        moe_intermediate_size=s.inter, num_experts=s.experts, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1)


DEMO_NUM_EXPERTS = 8  # tiny://demo's experts (the pre-launch checks read it: the model is built later)


def sized_config(build: ConfigBuilder, vocab_size: int = 128, num_experts: int = DEMO_NUM_EXPERTS, hidden_size: int = 32,
                 num_layers: int = 2, intermediate_size: int = 16, **overrides) -> PretrainedConfig:
    """The config ``build`` makes with every dimension tiny; ``overrides`` are set on it afterwards."""
    cfg = build(TinySizes(vocab=vocab_size, experts=num_experts, hidden=hidden_size, inter=intermediate_size,
                          layers=num_layers))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def model_from_config(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The model of ``config`` with its own initialisation, seeded."""
    torch.manual_seed(seed)
    return model_class_for(config).from_config(config, dtype=dtype)


def save_model(model: PreTrainedModel, path: str, tokenizer=None, max_shard_size: str | None = None) -> str:
    """``model`` (and ``tokenizer``) as a safetensors checkpoint under ``path``.

    transformers writes the hub layout (per-expert keys, renamed keys), as released checkpoints have it;
    ``max_shard_size`` (e.g. ``"40KB"``) splits it into several files with an index.
    """
    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def build_tokenizer(texts: list[str], vocab_size: int = 384):
    """A real byte-level BPE tokenizer trained on ``texts``, with a ChatML chat template.

    Deterministic for the same texts, so every node builds the same one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def prepare_tiny_model(path: str, texts: list[str], seed: int = 0, build_config: ConfigBuilder = qwen3_moe_config,
                       **sizes) -> str:
    """A tiny model (``build_config``'s family) with a tokenizer trained on ``texts``, written once to ``path``.

    ``sizes`` (``hidden_size``, ``num_layers``, ``max_shard_size``...) override the demo's.
    Written once to ``path`` (model.safetensors, config.json, tokenizer files);
    later calls reuse it. Written to a temporary directory and renamed, so an
    interrupted build never leaves a half checkpoint behind.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer(texts)
    max_shard_size = sizes.pop("max_shard_size", None)
    config = sized_config(build_config, vocab_size=len(tokenizer), **{"hidden_size": 64, "intermediate_size": 32,
                                                                      **sizes},
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return build_once(path, lambda tmp: save_model(model_from_config(config, seed), tmp, tokenizer, max_shard_size))


def build_once(path: str, build) -> str:
    """``build(tmp)`` into a temporary sibling of ``path``, renamed to ``path`` when done.

    Several processes may build the same demo model at once (simulated nodes): the first rename wins,
    and a loser whose rename fails finds the winner's complete checkpoint and uses it.
    """
    import shutil
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        build(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
    return path
