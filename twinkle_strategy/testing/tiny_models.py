"""Tiny, real MoE checkpoints of any family, for the tests, the benchmarks and scripts/models_table.py.

Each family's config builder (:data:`TINY_CONFIGS`) uses the transformers config class of an MoE
family with every size shrunk; any other transformers MoE config gets its defaults shrunk
(:func:`shrunk_default_config`). :func:`save_tiny_checkpoint` writes a real safetensors checkpoint
with ``save_pretrained``: the same files ``from_pretrained`` reads for a 30B model.
"""

from __future__ import annotations

import functools

import torch
import transformers as tf
from transformers import PretrainedConfig

from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.sources.tiny import (
    ConfigBuilder,
    TinySizes,
    model_from_config,
    qwen3_moe_config,
    save_model,
    sized_config,
)


def _qwen2_moe(s: TinySizes) -> PretrainedConfig:
    return tf.Qwen2MoeConfig(
        **s.common, num_hidden_layers=s.layers, intermediate_size=2 * s.inter, moe_intermediate_size=s.inter,
        shared_expert_intermediate_size=s.inter, num_experts=s.experts, num_experts_per_tok=2, decoder_sparse_step=1)


def _mixtral(s: TinySizes) -> PretrainedConfig:
    return tf.MixtralConfig(**s.common, num_hidden_layers=s.layers, intermediate_size=s.inter,
                            num_local_experts=s.experts, num_experts_per_tok=2)


def _deepseek_v3(s: TinySizes) -> PretrainedConfig:
    return tf.DeepseekV3Config(
        **s.common, num_hidden_layers=s.layers, intermediate_size=2 * s.inter, moe_intermediate_size=s.inter,
        n_routed_experts=s.experts, num_experts_per_tok=2, n_shared_experts=1,
        # Group-limited routing: 4 groups of experts, tokens may use the best 2 groups.
        n_group=4, topk_group=2, routed_scaling_factor=1.0, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)


def _llama4(s: TinySizes) -> PretrainedConfig:
    # Every layer MoE; one chunked-attention layer without RoPE, one full-attention layer.
    return tf.Llama4TextConfig(
        **s.common, **s.heads, num_hidden_layers=s.layers, intermediate_size=s.inter,
        intermediate_size_mlp=2 * s.inter, num_local_experts=s.experts, num_experts_per_tok=2,
        interleave_moe_layer_step=1, moe_layers=list(range(s.layers)), attention_chunk_size=8,
        no_rope_layers=[1, 0] * (s.layers // 2), layer_types=["chunked_attention", "full_attention"] * (s.layers // 2))


def _nemotron_h(s: TinySizes) -> PretrainedConfig:
    # Hybrid: Mamba-2, MoE, attention, MoE.
    return tf.NemotronHConfig(
        **s.common, **s.heads, layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        intermediate_size=2 * s.inter, n_routed_experts=s.experts, num_experts_per_tok=2,
        moe_intermediate_size=s.inter, moe_shared_expert_intermediate_size=s.inter,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, chunk_size=8)


def _longcat_flash(s: TinySizes) -> PretrainedConfig:
    # 8 routed experts + 4 zero-computation (identity) experts.
    return tf.LongcatFlashConfig(
        **{**s.common, "num_key_value_heads": s.common["num_attention_heads"]}, num_layers=s.layers,
        ffn_hidden_size=2 * s.inter, expert_ffn_hidden_size=s.inter, n_routed_experts=s.experts,
        zero_expert_num=s.experts // 2, moe_topk=2, routed_scaling_factor=1.0,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4, head_dim=4, v_head_dim=8)


def _deepseek_v4(s: TinySizes) -> PretrainedConfig:
    # Hash-routed MoE (by token id) in layer 0, learned routing after; compressed attention.
    return tf.DeepseekV4Config(
        **{**s.common, "num_key_value_heads": 1}, head_dim=16, q_lora_rank=16, num_hidden_layers=3,
        moe_intermediate_size=s.inter, n_routed_experts=s.experts, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.0, hc_mult=2, hc_sinkhorn_iters=3, num_nextn_predict_layers=0,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=8, index_topk=4)


def _gpt_oss(s: TinySizes) -> PretrainedConfig:
    return tf.GptOssConfig(
        **s.common, **s.heads, num_hidden_layers=s.layers, intermediate_size=s.inter, num_local_experts=s.experts,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (s.layers // 2),
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=s.common["max_position_embeddings"] // 4,
                             rope_theta=150000.0))


def _qwen3_next(s: TinySizes) -> PretrainedConfig:
    return tf.Qwen3NextConfig(
        **s.common, **s.heads, num_hidden_layers=s.layers, intermediate_size=2 * s.inter,
        moe_intermediate_size=s.inter, shared_expert_intermediate_size=s.inter, num_experts=s.experts,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * (s.layers // 2))


def _jamba(s: TinySizes) -> PretrainedConfig:
    # Mamba then attention, MoE in every layer.
    return tf.JambaConfig(
        **s.common, num_hidden_layers=s.layers, intermediate_size=s.inter, num_experts=s.experts,
        num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2)


def _gemma4(s: TinySizes) -> PretrainedConfig:
    # The text model; the expert output goes through its own RMSNorm.
    return tf.Gemma4TextConfig(
        **s.common, **s.heads, global_head_dim=s.hidden // 4, num_hidden_layers=s.layers,
        intermediate_size=2 * s.inter, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (s.layers // 2),
        vocab_size_per_layer_input=s.vocab, hidden_size_per_layer_input=4, enable_moe_block=True, num_experts=s.experts, top_k_experts=2, moe_intermediate_size=s.inter)


def _text_of_vision_language(s: TinySizes) -> dict:
    """The text config's sizes of a vision-language model (its config ties the embeddings, not its text model)."""
    return dict({k: v for k, v in s.common.items() if k != "tie_word_embeddings"}, **s.heads)


def _tiny_vision_tower(s: TinySizes, **extra) -> dict:
    return dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=s.hidden,
                patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, **extra)


def _qwen3_5_moe_vl(s: TinySizes) -> PretrainedConfig:
    # The vision-language class as released (a tiny vision tower), trained here through its text model.
    text = dict(_text_of_vision_language(s), moe_intermediate_size=s.inter, shared_expert_intermediate_size=s.inter,
                num_experts=s.experts, num_experts_per_tok=2, num_hidden_layers=s.layers,
                layer_types=["linear_attention", "full_attention"] * (s.layers // 2) + ["full_attention"] * (s.layers % 2),
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
    config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=_tiny_vision_tower(s), tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return config


def _qwen3_vl_moe(s: TinySizes) -> PretrainedConfig:
    # The vision-language class (there is no causal-LM class), with a tiny vision tower.
    text = dict(_text_of_vision_language(s), num_hidden_layers=s.layers, intermediate_size=2 * s.inter,
                moe_intermediate_size=s.inter, num_experts=s.experts, num_experts_per_tok=2, decoder_sparse_step=1,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                     mrope_interleaved=True))
    vision = _tiny_vision_tower(s, deepstack_visual_indexes=[0])
    config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    return config


def _dbrx(s: TinySizes) -> PretrainedConfig:
    return tf.DbrxConfig(
        d_model=s.hidden, n_heads=4, n_layers=s.layers, max_seq_len=s.common["max_position_embeddings"],
        vocab_size=s.vocab, initializer_range=s.common["initializer_range"],
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=s.inter, moe_num_experts=s.experts, moe_top_k=2))


def _jetmoe(s: TinySizes) -> PretrainedConfig:
    return tf.JetMoeConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=4,
        num_key_value_heads=2, kv_channels=s.hidden // 4, intermediate_size=s.inter, num_local_experts=s.experts,
        num_experts_per_tok=2, initializer_range=s.common["initializer_range"], tie_word_embeddings=False)


# Family -> its hand-written tiny config. A family not here (any transformers MoE model_type) gets its
# config's defaults shrunk (shrunk_default_config). The text models of Llama-4 and Gemma-4 answer to their
# transformers model_type too.
TINY_CONFIGS: dict[str, ConfigBuilder] = {
    "qwen3_moe": qwen3_moe_config,  # the demo's family (twinkle_strategy.train.demo_model)
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "nemotron_h": _nemotron_h,
    "longcat_flash": _longcat_flash,
    "deepseek_v4": _deepseek_v4,
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "qwen3_5_moe_vl": _qwen3_5_moe_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "dbrx": _dbrx,
    "jetmoe": _jetmoe,
}


def config_builder(family: str) -> ConfigBuilder:
    """``family``'s tiny config: hand-written, or any transformers MoE config with its defaults shrunk."""
    return TINY_CONFIGS.get(family) or functools.partial(shrunk_default_config, family)


# Size attributes of transformers configs and their tiny values (only those a config has are set).
# "hidden" and "inter" stand for the hidden and expert intermediate sizes asked for.
_TINY_SIZES = {
    "d_model": "hidden", "intermediate_size": "2*inter", "ffn_hidden_size": "2*inter", "intermediate_size_mlp": "2*inter",
    "dense_intermediate_size": "2*inter", "moe_intermediate_size": "inter", "expert_ffn_hidden_size": "inter",
    "shared_expert_intermediate_size": "inter", "moe_shared_expert_intermediate_size": "inter",
    "shared_experts_intermediate_size": "inter", "expert_intermediate_size": "inter",
    "n_heads": 4, "head_dim": 8, "kv_channels": 8, "global_head_dim": 8, "swa_head_dim": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "num_experts": "experts", "num_local_experts": "experts", "n_routed_experts": "experts", "moe_num_experts": "experts",
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k_experts": 2, "moe_top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16, "o_groups": 2,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_num_heads": 4, "mamba_head_dim": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
    "ssm_state_size": 8, "mamba_d_state": 4, "mamba_dt_rank": 4, "n_groups": 2, "chunk_size": 8, "mamba_chunk_size": 8,
    "sliding_window": 8, "attention_chunk_size": 8, "hidden_size_per_layer_input": 4,
    "vocab_size_per_layer_input": "vocab", "first_k_dense_replace": 1, "num_dense_layers": 1, "decoder_sparse_step": 1,
    "num_nextn_predict_layers": 0, "zero_expert_num": "experts//2",
}
# Sizes some configs leave None by default although their model needs them.
_TINY_REQUIRED = {"num_experts_per_tok", "n_routed_experts", "n_shared_experts", "head_dim"}
# What a few families need beyond the common shrinking (their configs validate these).
_TINY_OVERRIDES = {
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    "dots3_note_text": {"head_dim": 8},  # "SWA head_dim must equal qk_nope_head_dim + qk_rope_head_dim"
    # Defaults without an attention layer (all Mamba) or without a layer pattern at all.
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Its default indexed attention needs the QSA indexer sizes, which default to None.
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
}


def _representative_layers(defaults: dict, num_layers: int) -> list[int]:
    """Layer indices, in order, covering every distinct kind of layer the default config has.

    A layer's kind is its entry in every per-layer list (attention type, dense or
    sparse MLP ...) and its membership in every list of layer indices.
    """
    per_layer = [v for v in defaults.values() if isinstance(v, list) and len(v) == num_layers]
    index_lists = [v for k, v in defaults.items() if isinstance(v, list) and len(v) != num_layers
                   and k.endswith(("layers", "layer_ids")) and all(isinstance(i, int) for i in v)]
    chosen, seen = [], set()
    for i in range(num_layers):
        kind = tuple(str(v[i]) for v in per_layer) + tuple(i in s for s in index_lists)
        if kind not in seen:
            seen.add(kind)
            chosen.append(i)
    for i in range(num_layers):  # at least two layers
        if len(chosen) >= 2:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def shrunk_default_config(model_type: str, s: TinySizes) -> PretrainedConfig:
    """Any transformers MoE config: its defaults with every size tiny and one layer of each kind it has.

    For families without a hand-written tiny config (scripts/models_table.py runs them all).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ArgumentError(f"unknown tiny model family {model_type!r}; choose one of {sorted(TINY_CONFIGS)} "
                         "or a transformers model_type")
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    common = s.common
    values = {"hidden": s.hidden, "inter": s.inter, "2*inter": 2 * s.inter, "experts": s.experts,
              "experts//2": s.experts // 2, "vocab": s.vocab}
    kwargs = {k: v for k, v in common.items() if k in defaults}
    for key, size in _TINY_SIZES.items():
        if key in defaults and (defaults[key] is not None or key in _TINY_REQUIRED) and not isinstance(
                defaults[key], (dict, list)):
            kwargs[key] = values.get(size, size)
    # Every vocabulary size the config carries (transformers 5.24 gave Inkling-2 an ``unpadded_vocab_size`` that
    # sizes its lm_head): all of them tiny, whatever the family calls them.
    for key, value in defaults.items():
        if key.endswith("vocab_size") and isinstance(value, int) and value > common["vocab_size"]:
            kwargs[key] = common["vocab_size"]
    if defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)  # some configs require equal counts
    if "qk_rope_head_dim" in kwargs:
        kwargs.pop("head_dim", None)  # MLA configs derive it from qk_rope_head_dim
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(key), int) and defaults[key] >= common["vocab_size"]:
            kwargs[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    depth_key = next((k for k in ("num_hidden_layers", "n_layers", "num_layers") if isinstance(defaults.get(k), int)),
                     None)
    if depth_key is not None:
        num_default = defaults[depth_key]
        chosen = _representative_layers(defaults, num_default)
        kwargs[depth_key] = len(chosen)
        for key, value in defaults.items():
            if not isinstance(value, list):
                continue
            if len(value) == num_default:
                kwargs[key] = [value[i] for i in chosen]
            elif key.endswith(("layers", "layer_ids")) and all(isinstance(i, int) for i in value):
                kwargs[key] = [new for new, old in enumerate(chosen) if old in value]
        if isinstance(defaults.get("per_layer_config"), dict):
            kwargs["per_layer_config"] = {}
    kwargs.update(_TINY_OVERRIDES.get(model_type, {}))
    return config_class(**kwargs)


def tiny_config(family: str, vocab_size: int = 128, num_experts: int = 8, hidden_size: int = 32,
                num_layers: int = 2, intermediate_size: int = 16, **overrides) -> PretrainedConfig:
    """A transformers config of ``family`` with every dimension tiny."""
    return sized_config(config_builder(family), vocab_size=vocab_size, num_experts=num_experts,
                        hidden_size=hidden_size, num_layers=num_layers, intermediate_size=intermediate_size,
                        **overrides)


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A tiny ``family`` model, initialised for ``seed`` (and made so a lost tensor is noticed, below)."""
    cfg = tiny_config(family, **config_kwargs)
    model = model_from_config(cfg, seed, dtype)
    with torch.no_grad():
        for module in model.modules():
            # Non-zero correction bias (DeepSeek-V3 ...), so a checkpoint that lost it is noticed.
            bias = getattr(module, "e_score_correction_bias", None)
            if family == "deepseek_v3" and isinstance(bias, torch.Tensor):
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
    return save_model(build_tiny_model(family, seed=seed, **config_kwargs), path, tokenizer, max_shard_size)
