"""The init's transport without processes: backend devices, no object collectives, the send pool."""

import pathlib
import re
import threading

import torch

LIBRARY = pathlib.Path(__file__).resolve().parents[2] / "twinkle_strategy"


def test_collectives_move_tensors_on_the_backends_device():
    from twinkle_strategy.distributed.messages import device_type_for_backend

    assert device_type_for_backend("nccl") == "cuda"
    assert device_type_for_backend("hccl") == "npu"
    assert device_type_for_backend("gloo") == "cpu"
    assert device_type_for_backend("cpu:gloo,cuda:nccl") == "cuda"  # a mixed backend: the accelerator's
    assert device_type_for_backend("cpu:gloo,npu:hccl") == "npu"


def test_the_library_uses_no_object_collective():
    """HCCL lacks them (older torch_npu): the init, fail-together and the trainer use byte tensors instead."""
    pattern = re.compile(r"\b(all_gather_object|gather_object|broadcast_object_list|scatter_object_list)\(")
    offenders = [f"{path.relative_to(LIBRARY)}: {line.strip()}"
                 for path in LIBRARY.rglob("*.py")
                 for line in path.read_text().splitlines() if pattern.search(line)]
    assert offenders == []


def test_send_pool_is_reused_in_order_and_bounded():
    from twinkle_strategy.init.send_pool import ABORT, OK, FilledBuckets, SendPool

    pool = SendPool(3, bucket_bytes=8, device=torch.device("cpu"))
    schedule = [(peer, size) for peer in (1, 2, 3) for size in (8, 8, 5)]
    held, most_held, lock = set(), [0], threading.Lock()

    def fill(host, peer, size):
        with lock:
            held.add(id(host.untyped_storage()))
            most_held[0] = max(most_held[0], len(held))
        host.fill_(peer * 10 + size)

    got = []
    for slot, peer, size in FilledBuckets(schedule, fill, pool):
        message = slot.message(size)
        assert message.numel() == size + 1 and message[size] == OK
        assert torch.all(message[:size] == peer * 10 + size)
        got.append((peer, size))
        with lock:
            held.discard(id(slot.host.untyped_storage()))
        pool.release(slot)
    assert got == schedule
    assert most_held[0] <= 3 and len({id(s.host.untyped_storage()) for s in pool.slots}) == 3
    assert pool.slots[0].message(4, ABORT)[4] == ABORT


def test_a_read_error_reaches_the_sender():
    from twinkle_strategy.init.send_pool import FilledBuckets, SendPool

    pool = SendPool(2, bucket_bytes=4, device=torch.device("cpu"))

    def fill(host, peer, size):
        if peer == 2:
            raise OSError("No such file or directory: 'model-00002-of-00002.safetensors'")
        host.zero_()

    sent = []
    buckets = FilledBuckets([(1, 4), (1, 4), (2, 4), (2, 4)], fill, pool)
    for slot, peer, _ in buckets:
        sent.append(peer)
        pool.release(slot)
    assert sent == [1, 1] and isinstance(buckets.error, OSError)


def test_sending_order_serves_a_few_receivers_at_a_time_in_order():
    from twinkle_strategy.init.transport import interleaved

    plans = {1: [8, 8, 2], 2: [8], 3: [], 4: [8, 8], 5: [8, 1]}
    order = interleaved(plans, window=2)
    assert order == [(1, 8), (2, 8), (1, 8), (4, 8), (1, 2), (4, 8), (5, 8), (5, 1)]
    for rank, sizes in plans.items():  # each receiver's buckets in its own order, none lost
        assert [size for r, size in order if r == rank] == sizes
    started = [order.index(next(o for o in order if o[0] == r)) for r in (1, 2, 4, 5)]
    finished = [max(i for i, o in enumerate(order) if o[0] == r) for r in (1, 2, 4, 5)]
    for i in range(len(order)):  # never more than 2 streams begun and not finished
        assert sum(s <= i < f for s, f in zip(started, finished, strict=True)) <= 2


def test_the_board_names_the_ranks_that_failed_and_why():
    import torch.distributed as dist

    from twinkle_strategy.distributed.liveness import StatusBoard

    store, boards = dist.HashStore(), []
    for rank in range(3):  # each rank is a process of its own: the same namespace for all
        boards.append(StatusBoard("named", store=store, rank=rank, world=3, namespace="named"))
    boards[0].finished("plan")
    boards[2].failed("CheckpointError: checkpoint file model.safetensors ended while reading tensor 'w'")
    assert boards[1].failures() == [(2, "CheckpointError: checkpoint file model.safetensors ended while reading "
                                        "tensor 'w'")]
