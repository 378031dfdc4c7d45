"""Putting a model on the ranks: the steps of :class:`~twinkle_strategy.strategy.NativeFSDPStrategy`'s setup,
``from_pretrained`` and ``wrap_model``, in the order a run takes them.

process.py  the process's place in the run: the process group, the node topology, the parallel sizes and meshes
load.py     a model loaded on every rank: the whole model everywhere, or (memory_efficient_init) opened by each
            node's source while the other ranks build it on meta; objects a node shares, such as the tokenizer
wrap.py     a loaded model wrapped: expert parallelism, FSDP2, the memory-efficient init's transfer, sequence
            parallelism, and the optimizer pointed at the sharded parameters

The work itself is done by the packages these call (distributed/, parallel, loading, moe/, fsdp, init/,
sequence/); this package only orders it.
"""
