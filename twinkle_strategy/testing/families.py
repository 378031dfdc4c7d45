"""The test matrices: which tiny families each multi-process test runs (tests/, scripts/models_table.py)."""

# The four families the foundation tests run at ep=2 and ep=4.
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
# The family matrix (tests/multiproc/test_model_families.py): the families whose experts need more than
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
