"""Tiny, real MoE checkpoints for tests, demos and benchmarks.

Each builder uses the transformers config and model classes of an MoE family,
shrinks every size, and writes a real safetensors checkpoint with
``save_pretrained``: the same files ``from_pretrained`` reads for a 30B model.
"""

from __future__ import annotations

import os
import re

import torch

# The four families the foundation tests run at ep=2 and ep=4.
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
# The family matrix (tests/test_model_families.py): the families whose experts need more than
# the common routed contract (Llama-4's pre-routed call, Nemotron-H's non-gated experts,
# LongCat-Flash's zero-computation experts), and a representative set of the others.
MATRIX_FAMILIES = ("llama4", "nemotron_h", "longcat_flash", "qwen3_moe", "deepseek_v4", "gpt_oss", "qwen3_next",
                   "jamba", "gemma4")
# MoE families expert parallelism refuses (with ep_size > 1), naming the family.
REFUSED_FAMILIES = ("dbrx", "jetmoe")
# For the tests of checkpoint layouts: DeepSeek-V4 (renamed keys, hash routing) and Qwen3.5-MoE as
# released (a vision-language checkpoint, its text model under model.language_model.).
LAYOUT_FAMILIES = ("deepseek_v4", "qwen3_5_moe_vl")
# Vision-language MoE checkpoints (their own image-text-to-text class), trained on text.
VISION_LANGUAGE_FAMILIES = ("qwen3_5_moe_vl", "qwen3_vl_moe")


# transformers model_types of the text models whose tiny config is written by hand under a family name.
_FAMILY_OF_MODEL_TYPE = {"llama4_text": "llama4", "gemma4_text": "gemma4"}


def _config(family: str, common: dict, experts: int, hidden: int, inter: int, layers: int):
    """The config of ``family``: ``common`` sizes plus what the family calls its own."""
    import transformers as tf

    heads = dict(head_dim=hidden // 4)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, **heads, num_hidden_layers=layers, intermediate_size=2 * inter, moe_intermediate_size=inter,
            num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, num_hidden_layers=layers, intermediate_size=2 * inter, moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter, num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_hidden_layers=layers, intermediate_size=inter,
                                num_local_experts=experts, num_experts_per_tok=2)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common, num_hidden_layers=layers, intermediate_size=2 * inter, moe_intermediate_size=inter,
            n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
            # Group-limited routing: 4 groups of experts, tokens may use the best 2 groups.
            n_group=4, topk_group=2, routed_scaling_factor=1.0, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    if family == "llama4":
        # Every layer MoE; one chunked-attention layer without RoPE, one full-attention layer.
        return tf.Llama4TextConfig(
            **common, **heads, num_hidden_layers=layers, intermediate_size=inter, intermediate_size_mlp=2 * inter,
            num_local_experts=experts, num_experts_per_tok=2, interleave_moe_layer_step=1,
            moe_layers=list(range(layers)), attention_chunk_size=8, no_rope_layers=[1, 0] * (layers // 2),
            layer_types=["chunked_attention", "full_attention"] * (layers // 2))
    if family == "nemotron_h":
        # Hybrid: Mamba-2, MoE, attention, MoE.
        return tf.NemotronHConfig(
            **common, **heads, layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
            intermediate_size=2 * inter, n_routed_experts=experts, num_experts_per_tok=2,
            moe_intermediate_size=inter, moe_shared_expert_intermediate_size=inter,
            ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, chunk_size=8)
    if family == "longcat_flash":
        # 8 routed experts + 4 zero-computation (identity) experts.
        return tf.LongcatFlashConfig(
            **{**common, "num_key_value_heads": common["num_attention_heads"]}, num_layers=layers,
            ffn_hidden_size=2 * inter, expert_ffn_hidden_size=inter, n_routed_experts=experts,
            zero_expert_num=experts // 2, moe_topk=2, routed_scaling_factor=1.0,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4, head_dim=4, v_head_dim=8)
    if family == "deepseek_v4":
        # Hash-routed MoE (by token id) in layer 0, learned routing after; compressed attention.
        return tf.DeepseekV4Config(
            **{**common, "num_key_value_heads": 1}, head_dim=16, q_lora_rank=16, num_hidden_layers=3,
            moe_intermediate_size=inter, n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
            routed_scaling_factor=1.0, hc_mult=2, hc_sinkhorn_iters=3, num_nextn_predict_layers=0,
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=8, index_topk=4)
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **common, **heads, num_hidden_layers=layers, intermediate_size=inter, num_local_experts=experts,
            num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                 original_max_position_embeddings=common["max_position_embeddings"] // 4,
                                 rope_theta=150000.0))
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(
            **common, **heads, num_hidden_layers=layers, intermediate_size=2 * inter, moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter, num_experts=experts, num_experts_per_tok=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"] * (layers // 2))
    if family == "jamba":
        # Mamba then attention, MoE in every layer.
        return tf.JambaConfig(
            **common, num_hidden_layers=layers, intermediate_size=inter, num_experts=experts, num_experts_per_tok=2,
            expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
            mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2)
    if family == "gemma4":
        # The text model; the expert output goes through its own RMSNorm.
        return tf.Gemma4TextConfig(
            **common, **heads, global_head_dim=hidden // 4, num_hidden_layers=layers, intermediate_size=2 * inter,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            vocab_size_per_layer_input=common["vocab_size"], hidden_size_per_layer_input=4,
            enable_moe_block=True, num_experts=experts, top_k_experts=2, moe_intermediate_size=inter)
    if family == "qwen3_5_moe_vl":
        # The vision-language class as released (a tiny vision tower), trained here through its text model.
        text = dict({k: v for k, v in common.items() if k != "tie_word_embeddings"}, **heads,
                    moe_intermediate_size=inter, shared_expert_intermediate_size=inter, num_experts=experts,
                    num_experts_per_tok=2, num_hidden_layers=layers,
                    layer_types=["linear_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2),
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4)
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        return config
    if family == "qwen3_vl_moe":
        # The vision-language class (there is no causal-LM class), with a tiny vision tower.
        text = dict({k: v for k, v in common.items() if k != "tie_word_embeddings"}, **heads,
                    num_hidden_layers=layers, intermediate_size=2 * inter, moe_intermediate_size=inter,
                    num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                         mrope_interleaved=True))
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
        config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
        return config
    if family == "dbrx":
        return tf.DbrxConfig(
            d_model=hidden, n_heads=4, n_layers=layers, max_seq_len=common["max_position_embeddings"],
            vocab_size=common["vocab_size"], initializer_range=common["initializer_range"],
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=inter, moe_num_experts=experts, moe_top_k=2))
    if family == "jetmoe":
        return tf.JetMoeConfig(
            vocab_size=common["vocab_size"], hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, kv_channels=hidden // 4, intermediate_size=inter, num_local_experts=experts,
            num_experts_per_tok=2, initializer_range=common["initializer_range"], tie_word_embeddings=False)
    return _shrunk_default_config(family, common, experts, hidden, inter, layers)


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


def _shrunk_default_config(model_type: str, common: dict, experts: int, hidden: int, inter: int, layers: int):
    """Any transformers MoE config: its defaults with every size tiny and one layer of each kind it has.

    For families without a hand-written tiny config (scripts/models_table.py runs them all).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        known = FAMILIES + MATRIX_FAMILIES + REFUSED_FAMILIES
        raise ValueError(f"unknown tiny model family {model_type!r}; choose one of {sorted(set(known))} "
                         "or a transformers model_type")
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    values = {"hidden": hidden, "inter": inter, "2*inter": 2 * inter, "experts": experts,
              "experts//2": experts // 2, "vocab": common["vocab_size"]}
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
                num_layers: int = 2, intermediate_size: int = 16, **overrides):
    """A transformers config of ``family`` with every dimension tiny."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # A wide init makes router scores far apart, so top-k choices do not
        # flip on last-bit differences between a sharded and a single-process run.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    cfg = _config(_FAMILY_OF_MODEL_TYPE.get(family, family), common, num_experts, hidden_size, intermediate_size,
                  num_layers)
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


def prepare_demo_model(path: str, dataset_paths: str | list[str], family: str = "qwen3_moe", seed: int = 0,
                       **sizes) -> str:
    """The embedded default: a tiny ``family`` model with a tokenizer trained on the dataset file(s).

    ``sizes`` (``hidden_size``, ``num_layers``, ``max_shard_size``...) override the demo's.
    Written once to ``path`` (model.safetensors, config.json, tokenizer files);
    later calls reuse it. Written to a temporary directory and renamed, so an
    interrupted build never leaves a half checkpoint behind.
    """

    from twinkle_strategy.train.data import read_rows

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    texts = []
    for dataset_path in [dataset_paths] if isinstance(dataset_paths, str) else dataset_paths:
        rows, _ = read_rows(dataset_path)  # rows training will skip do not shape the vocabulary either
        texts.extend(m["content"] for _, messages in rows for m in messages if isinstance(m["content"], str))
    tokenizer = build_tokenizer(texts)
    return build_once(path, lambda tmp: save_tiny_checkpoint(
        family, tmp, seed=seed, tokenizer=tokenizer, vocab_size=len(tokenizer),
        **{"hidden_size": 64, "intermediate_size": 32, **sizes},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


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


# Checkpoint keys that quantized releases store in FP8 (attention and MLP projections, experts included);
# embeddings, norms, routers and lm_head stay as they are.
_QUANTIZED_KEY = re.compile(r"(proj|proj_with_mqa|\.w[a-z0-9_]*)\.weight$")


def save_tiny_quantized_checkpoint(family: str, path: str, block: tuple[int, int] = (16, 16), seed: int = 0,
                                   scale_dtype: torch.dtype = torch.float32, files: int = 4,
                                   dtype: torch.dtype = torch.bfloat16, **config_kwargs) -> str:
    """A tiny ``family`` checkpoint laid out as its FP8 hub releases (DeepSeek-V3, Qwen3 "-FP8"): every
    projection weight float8_e4m3fn with a per-block ``weight_scale_inv`` (``scale_dtype``), the rest as
    trained, in ``files`` files (a weight and its scale often in different files) with an index."""
    from twinkle_strategy.checkpoint.quantized import quantize_fp8_blocks

    config, tensors = _hub_tensors(family, seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        if value.dim() == 2 and _QUANTIZED_KEY.search(key):
            out[key], scale = quantize_fp8_blocks(value, block)
            out[key + "_scale_inv"] = scale.to(scale_dtype)
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block))
    return _write_release(path, config, out, files)


def _hub_tensors(family: str, seed: int, dtype: torch.dtype, **config_kwargs) -> tuple:
    """The config and the checkpoint tensors (hub keys, as ``save_pretrained`` writes them) of a tiny model."""
    import tempfile

    from safetensors.torch import load_file

    model = build_tiny_model(family, seed=seed, dtype=dtype, **config_kwargs)
    with tempfile.TemporaryDirectory(prefix="twinkle-release-") as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        return model.config, load_file(os.path.join(scratch, "model.safetensors"))


def _write_release(path: str, config, tensors: dict, files: int) -> str:
    """``tensors`` in ``files`` safetensors files, dealt round-robin in key order, with an index, and config.json."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    keys = sorted(tensors)
    weight_map = {key: names[i % files] for i, key in enumerate(keys)}
    for name in names:
        part = {k: tensors[k].contiguous() for k in keys if weight_map[k] == name}
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(path)
    return path


def save_tiny_deepseek_v4_release(path: str, block: tuple[int, int] = (16, 16), seed: int = 0, files: int = 4,
                                  dtype: torch.dtype = torch.bfloat16, **config_kwargs) -> str:
    """A tiny DeepSeek-V4 checkpoint laid out as DeepSeek-V4-Flash ships: keys without ``model.``, dense
    projections FP8 with a ue8m0 ``.scale`` per block, routed experts FP4 (int8 bytes, two e2m1 values each,
    low nibble first, ``[out, in / 2]``) with a ue8m0 ``.scale`` ``[out, in / 32]``."""
    from twinkle_strategy.checkpoint.quantized import quantize_fp4_groups, quantize_fp8_blocks

    config, tensors = _hub_tensors("deepseek_v4", seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        key = _v4_release_key(key)
        if value.dim() == 2 and _QUANTIZED_KEY.search(key):
            stem = key[:-len("weight")]
            routed = ".experts." in key
            out[key], out[stem + "scale"] = (quantize_fp4_groups(value) if routed
                                             else quantize_fp8_blocks(value, block, ue8m0=True))
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block), scale_fmt="ue8m0")
    config.expert_dtype = "fp4"
    return _write_release(path, config, out, files)


def _v4_release_key(key: str) -> str:
    """DeepSeek-V4-Flash's own names: no ``model.`` prefix, ``embed`` and ``hc_head_*`` at the top."""
    key = key.removeprefix("model.")
    key = re.sub(r"^embed_tokens\.", "embed.", key)
    return re.sub(r"^hc_head\.hc_", "hc_head_", key)


def save_tiny_mxfp4_release(path: str, seed: int = 0, files: int = 4, dtype: torch.dtype = torch.bfloat16,
                            **config_kwargs) -> str:
    """A tiny gpt-oss checkpoint laid out as gpt-oss ships: experts MXFP4 (``*_blocks`` uint8
    ``[E, out, in / 32, 16]`` and ``*_scales`` uint8 exponents ``[E, out, in / 32]``), the rest bf16."""
    from twinkle_strategy.checkpoint.quantized import quantize_mxfp4

    config, tensors = _hub_tensors("gpt_oss", seed, dtype, **config_kwargs)
    out = {}
    for key, value in tensors.items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[key + "_blocks"], out[key + "_scales"] = quantize_mxfp4(value)
        else:
            out[key] = value
    config.quantization_config = dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])
    return _write_release(path, config, out, files)
