"""Tiny, real MoE checkpoints for tests, demos and benchmarks.

Each builder uses the transformers config and model classes of a family our
users train (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3), shrinks every size,
and writes a real safetensors checkpoint with ``save_pretrained``: the same
files ``from_pretrained`` reads for a 30B model.
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
# More families, for the tests of checkpoint layouts: DeepSeek-V4 (renamed keys, hash routing) and
# Qwen3.5-MoE as released (a vision-language checkpoint, text model under model.language_model.).
LAYOUT_FAMILIES = ("deepseek_v4", "qwen3_5_moe_vl")


def tiny_config(family: str, vocab_size: int = 128, num_experts: int = 8, hidden_size: int = 32,
                num_layers: int = 2, intermediate_size: int = 16, **overrides):
    """A transformers config of ``family`` with every dimension tiny."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # A wide init makes router scores far apart, so top-k choices do not
        # flip on last-bit differences between a sharded and a single-process run.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **common, head_dim=hidden_size // 4, intermediate_size=2 * intermediate_size,
            moe_intermediate_size=intermediate_size, num_experts=num_experts, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1,
        )
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **common, intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
            shared_expert_intermediate_size=intermediate_size, num_experts=num_experts, num_experts_per_tok=2,
            decoder_sparse_step=1,
        )
    elif family == "mixtral":
        cfg = tf.MixtralConfig(
            **common, intermediate_size=intermediate_size, num_local_experts=num_experts, num_experts_per_tok=2,
        )
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            **common, intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
            n_routed_experts=num_experts, num_experts_per_tok=2, n_shared_experts=1,
            # Group-limited routing: 4 groups of experts, tokens may use the best 2 groups.
            n_group=4, topk_group=2, routed_scaling_factor=1.0, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        )
    elif family == "deepseek_v4":
        cfg = tf.DeepseekV4Config(
            **{k: v for k, v in common.items() if k != "num_key_value_heads"}, num_key_value_heads=1,
            head_dim=16, q_lora_rank=16, moe_intermediate_size=intermediate_size, n_routed_experts=num_experts,
            num_experts_per_tok=2, n_shared_experts=1, o_groups=2, o_lora_rank=16, index_n_heads=2,
            index_head_dim=8, index_topk=4, sliding_window=8, num_nextn_predict_layers=0, hc_mult=2,
            # Two hash-routed MoE layers (a frozen token -> experts table), then learned routing.
            mlp_layer_types=["hash_moe"] * (num_layers - 1) + ["moe"],
        )
    elif family == "qwen3_5_moe_vl":
        text = dict(
            {k: v for k, v in common.items() if k != "tie_word_embeddings"}, head_dim=8,
            moe_intermediate_size=intermediate_size, shared_expert_intermediate_size=intermediate_size,
            num_experts=num_experts, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"] * (num_layers // 2) + ["full_attention"] * (
                num_layers % 2),
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    else:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {FAMILIES + LAYOUT_FAMILIES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    from twinkle_strategy.loading import model_class_for

    cfg = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = model_class_for(cfg).from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for module in model.modules():
            # Non-zero correction bias (DeepSeek-V3), so a checkpoint that lost it is noticed.
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn_like(bias) * 0.01)
            # A real hash table (DeepSeek-V4 hash_moe layers; all zeros after init): each token its own experts.
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):
                experts = torch.rand(table.shape[0], cfg.n_routed_experts).argsort(dim=1)[:, :table.shape[1]]
                table.copy_(experts.to(table.dtype))
    return model


def save_tiny_checkpoint(family: str, path: str, seed: int = 0, tokenizer=None, max_shard_size: str | None = None,
                         **config_kwargs) -> str:
    """Build a tiny ``family`` model and save it as a safetensors checkpoint under ``path``.

    transformers writes the hub layout (per-expert keys, renamed keys), as released checkpoints have it;
    ``max_shard_size`` (e.g. ``"40KB"``) splits it into several files with an index.
    """
    model = build_tiny_model(family, seed=seed, **config_kwargs)
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


def prepare_demo_model(path: str, dataset_path: str, family: str = "qwen3_moe", seed: int = 0) -> str:
    """The embedded default: a tiny ``family`` model with a tokenizer trained on the demo dataset.

    Written once to ``path`` (model.safetensors, config.json, tokenizer files);
    later calls reuse it. Written to a temporary directory and renamed, so an
    interrupted build never leaves a half checkpoint behind.
    """
    import json
    import shutil
    import tempfile

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    texts = []
    with open(dataset_path) as f:
        for line in f:
            row = json.loads(line)
            if "messages" in row:
                texts.extend(m["content"] for m in row["messages"])
            else:
                texts.extend([row.get("query", ""), row.get("response", "")])
    tokenizer = build_tokenizer(texts)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        save_tiny_checkpoint(family, tmp, seed=seed, tokenizer=tokenizer, vocab_size=len(tokenizer),
                             hidden_size=64, intermediate_size=32,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
    return path
