"""memory_efficient_init: each node's local rank 0 reads the checkpoint, every rank receives only its shard.

skeleton.py   the model built on meta, with placeholders for the weights a streaming source reads later
capture.py    the source's pre-EP tensors, by reference; turning a model into meta without breaking ties
streams.py    a rank's regions as one byte stream: read on the source, written into its shards on the receiver
send_pool.py  the source's send pool: a fixed pool of buffers (bounded memory whatever the ranks per node)
transport.py  the weights on the wire: bucketed streams from a node's source to its ranks (p2p or scatter)
engine.py     the steps in order (plan, transfer, agree)
report.py     the InitReport: what the init did on a rank, its bytes counted, the line it logs
verify.py     verify_init: each region's CRC32 compared with its source's, in the agree step

Who needs which rows is :mod:`twinkle_strategy.shards.plan`; control messages and fail-together are
:mod:`twinkle_strategy.distributed`; regions of a quantized release travel as :mod:`twinkle_strategy.quantized.wire`.
"""
