"""Fixtures for the tests, the benchmarks and scripts/models_table.py; not part of the library.

Shipped in the package (not under tests/) because benchmarks/ and scripts/ import them from an
installed copy. The library (``twinkle_strategy`` outside ``train``, ``testing`` and ``integrations``)
never imports from here; a test checks it.

families.py     the test matrices: which tiny families each multi-process test runs
tiny_models.py  tiny real checkpoints of any MoE family: a ``{family: config builder}`` registry, and
                any other transformers MoE config with its defaults shrunk
releases.py     tiny quantized releases as they ship (FP8 blocks, DeepSeek-V4 FP8/FP4, gpt-oss MXFP4)
tiny_vision.py  tiny vision-language checkpoints with a real processor, and generated image-text data
"""
