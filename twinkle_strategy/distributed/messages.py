"""Small pickled messages (configs, plans, errors) over tensor collectives on the backend's device.

torch's object collectives (``gather_object``, ``all_gather_object``,
``broadcast_object_list``) are missing or unreliable on some backends (older
torch_npu HCCL lacks ``gather``), and a tensor a collective touches must live
on the backend's device: CUDA for NCCL, the NPU for HCCL, the CPU for gloo.
So a message travels as its pickled bytes in a uint8 tensor on
:func:`collective_device`, its size exchanged first, through collectives every
backend has: ``all_gather``, ``broadcast`` and paired point-to-point sends (gather and scatter are
built from those).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

# The device type each backend moves tensors on; a backend not listed uses the accelerator, if any.
DEVICE_FOR_BACKEND = {"nccl": "cuda", "hccl": "npu", "gloo": "cpu"}


def device_type_for_backend(backend: str) -> str:
    """``'cuda'`` for NCCL, ``'npu'`` for HCCL, ``'cpu'`` for gloo; a mixed backend (``'cpu:gloo,cuda:nccl'``)
    gives its accelerator's device."""
    names = [part.rpartition(":")[2] for part in backend.lower().split(",")]
    for name in names:
        if DEVICE_FOR_BACKEND.get(name, "cpu") != "cpu":
            return DEVICE_FOR_BACKEND[name]
    if all(name in DEVICE_FOR_BACKEND for name in names):
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def collective_device(group=None) -> torch.device:
    """The device every tensor of a collective on ``group`` must live on."""
    device_type = device_type_for_backend(str(dist.get_backend(group)))
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def _encode(obj, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _decode(payload: torch.Tensor):
    return pickle.loads(payload.cpu().numpy().tobytes())


def _all_sizes(size: int, group, device: torch.device) -> list[int]:
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    return [int(s.item()) for s in sizes]


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` of ``group``, in group-rank order, on every rank."""
    device = collective_device(group)
    payload = _encode(obj, device)
    sizes = _all_sizes(payload.numel(), group, device)
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()].copy_(payload)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [_decode(part[:size]) for part, size in zip(parts, sizes, strict=True)]


def broadcast_object(obj, src: int, group=None):
    """``obj`` of global rank ``src``, on every rank of ``group``."""
    device = collective_device(group)
    is_src = dist.get_rank() == src
    payload = _encode(obj, device) if is_src else None
    size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not is_src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload.numel():
        dist.broadcast(payload, src=src, group=group)
    return obj if is_src else _decode(payload)


def gather_objects(obj, dst: int, group=None) -> list | None:
    """Every rank's ``obj`` of ``group`` in group-rank order on global rank ``dst``, None elsewhere.

    Sizes go everywhere (a few bytes per rank); the payloads only to ``dst``, by paired point-to-point
    transfers, so no rank but ``dst`` holds more than its own message.
    """
    device = collective_device(group)
    payload = _encode(obj, device)
    sizes = _all_sizes(payload.numel(), group, device)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    if me != dst:
        if payload.numel():
            wait_all(dist.batch_isend_irecv([dist.P2POp(dist.isend, payload, dst, group=group)]))
        return None
    parts = [payload if rank == me else torch.empty(size, dtype=torch.uint8, device=device)
             for rank, size in zip(ranks, sizes, strict=False)]
    ops = [dist.P2POp(dist.irecv, part, rank, group=group)
           for rank, part in zip(ranks, parts, strict=False) if rank != me and part.numel()]
    if ops:
        wait_all(dist.batch_isend_irecv(ops))
    return [obj if rank == me else _decode(part) for rank, part in zip(ranks, parts, strict=False)]


def wait_all(works) -> None:
    """Wait for every work of a ``batch_isend_irecv``."""
    for work in works:
        work.wait()


def scatter_objects(objs: list | None, src: int, group=None):
    """Group rank i's ``objs[i]`` (given on global rank ``src`` only), on every rank of ``group``.

    The sizes go everywhere in one broadcast (a few bytes per rank); each payload only to its rank.
    """
    device = collective_device(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    payloads = [_encode(obj, device) for obj in objs] if me == src else None
    sizes = torch.tensor([p.numel() for p in payloads] if me == src else [0] * len(ranks), dtype=torch.int64,
                         device=device)
    dist.broadcast(sizes, src=src, group=group)
    if me == src:
        ops = [dist.P2POp(dist.isend, payload, rank, group=group)
               for rank, payload in zip(ranks, payloads, strict=False) if rank != me]
        if ops:
            wait_all(dist.batch_isend_irecv(ops))
        return objs[ranks.index(me)]
    payload = torch.empty(int(sizes[ranks.index(me)].item()), dtype=torch.uint8, device=device)
    wait_all(dist.batch_isend_irecv([dist.P2POp(dist.irecv, payload, src, group=group)]))
    return _decode(payload)
