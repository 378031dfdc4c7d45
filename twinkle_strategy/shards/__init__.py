"""Each rank's shard of each tensor: below both ``init/`` and ``checkpoint/``, which both use it.

plan.py           pure: which region (EP slice, FSDP rows) of which pre-EP tensor a rank keeps
whole_tensors.py  tensors a save or resume must see whole, held by one owner rank at a time
gather.py         the unsharded model as one plain state dict, on rank 0 or on every rank
"""
