"""The plan-vs-run test's byte counter (tests/workers/alloc_tracker.py) against allocations of known size.

The oracle must be right before the plan is judged by it: plain tensors, a DTensor's local storage (what
``to_empty`` makes for FSDP2's shards, AdamW's states), storages FSDP2 resizes, a thread's tensors, and
frees of each. One process, a world of one (gloo).
"""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from workers.alloc_tracker import LiveBytes


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def test_a_plain_tensor_is_counted_while_alive():
    with LiveBytes() as tracker:
        t = torch.empty(1000, dtype=torch.float32)
        assert tracker.live == 4000
        view = t[10:20]  # a view: no new storage
        assert tracker.live == 4000
        del t, view
        assert tracker.live == 0
    assert tracker.peak == 4000


def test_a_dtensors_local_storage_is_counted(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    source = torch.ones(64, 8)  # made before the tracker: not counted
    with LiveBytes() as tracker:
        shard = distribute_tensor(source, mesh, [Shard(0)])
        after_distribute = tracker.live
        zeros = torch.zeros_like(shard)  # what AdamW's states are
        assert tracker.live - after_distribute == 64 * 8 * 4
        del zeros
        assert tracker.live == after_distribute


def test_fsdp2_shards_from_to_empty_and_adamw_state_are_counted(mesh):
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False))
    fully_shard(model, mesh=mesh)
    param_bytes = (32 * 32 + 32 * 16) * 4
    with LiveBytes() as tracker:
        model.to_empty(device="cpu")
        for p in model.parameters():
            nn.init.ones_(p)
        assert tracker.live == param_bytes
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        tracker.mark()
        model(torch.ones(4, 32)).sum().backward()
        optimizer.step()
        # Gradients, exp_avg and exp_avg_sq like the shards, one float32 step counter per parameter.
        states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in
                     (s["exp_avg"].to_local(), s["exp_avg_sq"].to_local(), s["step"]))
        assert states == 2 * param_bytes + 2 * 4
        assert tracker.live - tracker.base == param_bytes + states  # gradients and states alive now, exactly
        assert tracker.extra_peak >= param_bytes + states


def test_a_resized_storage_counts_its_new_size():
    with LiveBytes() as tracker:
        t = torch.empty(256, dtype=torch.uint8)
        t.untyped_storage().resize_(0)  # how FSDP2 frees an unsharded parameter
        assert tracker.live == 0
        t.untyped_storage().resize_(1024)  # and allocates it again
        assert tracker.live == 1024
        del t
        assert tracker.live == 0
    assert tracker.peak == 1024


def test_a_threads_tensors_are_counted():
    held = []
    with LiveBytes() as tracker:
        thread = threading.Thread(target=lambda: held.append(torch.empty(500, dtype=torch.uint8)))
        thread.start()
        thread.join()
        assert tracker.live == 500
        held.clear()
        assert tracker.live == 0
