"""memory_efficient_init: each node's local rank 0 reads the checkpoint, every rank receives only its shard.

capture.py    the source's pre-EP tensors, by reference; turning a model into meta without breaking ties
plan.py       pure: which region of which pre-EP tensor a rank needs, derived from its DTensors
transport.py  every collective of the init: config broadcast, needs gather, fail-together, bucketed scatter
engine.py     the steps in order, and the InitReport
"""
