"""Process-level plumbing: the lowest layer, which imports nothing of the package but ``errors``.

runtime.py        device, backend, what torchrun told this process, the process group, host memory
messages.py       small pickled messages over tensor collectives on the backend's device
node.py           which ranks share a node (the topology), NodeLink, and the node source's broadcast/gather/scatter
fail_together.py  an error on one rank becomes the same error on every rank; ``collectively(...)``
liveness.py       naming the rank that died or hung (a status board in the job's store)
fatal_errors.py   the one line a rank prints when a package error ends it (root cause first, once per node)
dtensor.py        helpers for tensors that may be DTensors
grad_clip.py      gradient-norm clipping over parameters on several meshes
launch_conflicts.py  what accelerate's launcher asks for that would shard the model too, refused before the load
teardown.py       what the strategy started, stopped in order while Python runs: at exit, or at shutdown()

Nothing above this package knows how a message travels.
"""
