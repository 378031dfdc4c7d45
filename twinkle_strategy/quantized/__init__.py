"""Quantized releases (FP8 blocks, DeepSeek-V4 FP8/FP4, MXFP4), for the readers of checkpoints and the init.

formats.py  every fact about the formats: which releases stream, which tensors are quantized, their scales,
            a quantized checkpoint read as the checkpoint of its values
codec.py    the math: stored bytes to float32 values (and back, for the test releases); a Codec per region
wire.py     regions sent as stored (quantized bytes and scales) and dequantized by the receiving rank
kept.py     quantized_base=keep: regions kept as stored, decoded for each FSDP2 all-gather of their unit

It imports neither ``init/`` nor ``checkpoint/``: key layouts come in with the layout object a caller passes.
"""
